"""The ``xla`` compiler: ``jax.jit(...).lower(...).compile()`` with device placement, and ``to_mlir``
(the same lowering, stopped at StableHLO text; the ``iree`` compiler starts from it).

``jit`` dispatch goes straight to ``jax.jit``'s C++ fast path, which already
keys its cache on shapes and dtypes; jitserve only counts the traces. The
persistent compile cache is JAX's own (``jax_compilation_cache_dir``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from ..errors import CompileError, OptionError, defn_errors
from ..template import Template, abstract_tree, template_of, templates_of
from .base import Compiler, Device, Executable, flat_templates

_cache_lock = threading.Lock()
_cache_dir_in_use: str | None = None


def enable_persistent_cache(cache_dir: str | None) -> None:
    """Point JAX's compilation cache at ``cache_dir`` (process-wide, as JAX's cache is)."""
    global _cache_dir_in_use
    if cache_dir is None or cache_dir == _cache_dir_in_use:
        return
    with _cache_lock:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _cache_dir_in_use = cache_dir


def run_cpu_computations_inline() -> None:
    """In a process whose job is serving (``jitserve serve`` and ``jitserve bench``, a partition's worker
    process, a Ray replica): run XLA's CPU computations on the thread that calls them, a partition,
    instead of handing each to XLA's dispatch thread and blocking on it (JAX's
    ``jax_cpu_enable_async_dispatch``). A partition waits for every result as soon as it has dispatched,
    so the hand-off is pure cost: 10-15 % of a batch-64 MLP's time on a 2-core machine, more on small
    batches. The computation still releases the GIL. JAX reads the setting when it creates its CPU client,
    so this is called before anything runs on it: before the user's module is imported. Process-wide;
    no effect on GPUs."""
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def resolve_device(device: Any) -> jax.Device:
    """A ``jax.Device`` from a Device, a jax device, an index, or ``"platform[:index]"``."""
    if isinstance(device, jax.Device):
        return device
    if isinstance(device, Device):
        if device.compiler != "xla":
            raise OptionError(f"device {device.uri} belongs to compiler {device.compiler!r}, not 'xla'")
        return device.handle
    if isinstance(device, int):
        found = jax.devices()
        if not 0 <= device < len(found):
            raise OptionError(f"device index {device} is out of range; there are {len(found)} XLA devices")
        return found[device]
    if isinstance(device, str):
        platform, _, index = device.removeprefix("xla:").partition(":")
        try:
            found = jax.devices(platform)
        except RuntimeError as error:
            raise OptionError(f"no XLA devices of platform {platform!r}: {error}") from None
        position = int(index or 0)
        if not 0 <= position < len(found):
            raise OptionError(f"device {device!r} does not exist; {platform} has {len(found)} devices")
        return found[position]
    raise OptionError(f"cannot use {device!r} as an XLA device; pass a jax.Device, an index or 'cpu:0'")


def _output_container(out_info: Any) -> Any:
    return jax.tree_util.tree_map(template_of, out_info)


class XlaCompiler(Compiler):
    name = "xla"
    options = frozenset({"device"})
    shards = True
    pages = True

    def _jit(self, fn: Callable[..., Any], options: Mapping[str, Any], donate: Sequence[int] = (),
             shardings: tuple[Any, Any] | None = None) -> Any:
        enable_persistent_cache(options.get("cache_dir"))
        device = options.get("device")
        if shardings is None and device is None:
            return jax.jit(fn, donate_argnums=tuple(donate))
        if shardings is None:
            sharding = SingleDeviceSharding(resolve_device(device))
            shardings = (sharding, sharding)
        return jax.jit(fn, in_shardings=shardings[0], out_shardings=shardings[1], donate_argnums=tuple(donate))

    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                donate: Sequence[int] = ()) -> Executable:
        return self._compiled(self._jit(fn, options, donate), templates)

    def compile_sharded(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                        shardings: tuple[Any, Any], donate: Sequence[int] = ()) -> Executable:
        """See :meth:`Compiler.compile_sharded`; XLA's GSPMD partitions the program and adds the collectives
        (the all-reduce after a matrix split on its input axis). The ``device`` option is not used: the
        shardings name the devices."""
        return self._compiled(self._jit(fn, options, donate, shardings), templates)

    @staticmethod
    def _compiled(jitted: Any, templates: Sequence[Any]) -> Executable:
        compiled = jitted.lower(*abstract_tree(tuple(templates))).compile()
        flat, tree = flat_templates(templates)
        return Executable(compiled, flat, tree, _output_container(compiled.out_info))

    def dispatcher(
        self, fn: Callable[..., Any], options: Mapping[str, Any], on_compile: Callable[[], None]
    ) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            on_compile()
            return fn(*args)

        return self._jit(traced, options)

    def place(self, tree: Any, options: Mapping[str, Any]) -> Any:
        device = options.get("device")
        placed = jax.device_put(tree, resolve_device(device) if device is not None else jax.devices()[0])
        return jax.block_until_ready(placed)  # copied now: the host arrays may be released once this returns

    def first_run_costs(self, options: Mapping[str, Any]) -> bool:
        """On every platform: a GPU loads its kernels then, and XLA's CPU runtime compiles an executable's
        kernels at its first run (a 124.7 M Llama's first prefill of 128 tokens: 250 ms, then 124 ms)."""
        return True

    def devices(self) -> list[Device]:
        found = []
        for device in jax.devices():
            found.append(Device(
                compiler=self.name, driver=device.platform, id=device.id,
                uri=f"xla:{device.platform}:{device.id}", description=device.device_kind, handle=device,
            ))
        return found

    def partitions(self, options: Mapping[str, Any]) -> list[dict[str, Any]]:
        if options.get("device") is not None:
            return [dict(options)]
        return [{**options, "device": device} for device in jax.devices()]


@dataclass(frozen=True)
class MLIRModule:
    """``fn`` lowered to StableHLO (``EXLA.to_mlir_module``).

    ``used_inputs`` are the indices, over the flattened inputs, of those that
    the module's ``@main`` takes: unused inputs are dropped from its signature.
    """

    mlir_module: str
    output_container: Any
    used_inputs: tuple[int, ...]
    input_templates: tuple[Template, ...]


def _kept_inputs(lowered: Any) -> tuple[int, ...]:
    """The flat inputs ``@main`` keeps after JAX drops unused ones.

    JAX has no public API for this: ``Lowered.args_info`` and ``in_avals`` list every input, and
    ``jit(keep_unused=True)`` would keep them all (IREE would then be sent unused inputs on every call).
    So this reads the lowering's compile arguments; ``tests/test_defn.py`` checks the result against the
    signature of ``@main`` in the module text, and fails loudly if JAX moves or changes them.
    """
    try:
        return tuple(sorted(lowered._lowering.compile_args["kept_var_idx"]))
    except (AttributeError, KeyError, TypeError) as error:
        raise CompileError(f"this JAX ({jax.__version__}) no longer says which inputs a lowered module keeps "
                           f"(Lowered._lowering.compile_args['kept_var_idx']); jitserve.to_mlir needs updating "
                           f"for it") from error


def to_mlir(fn: Callable[..., Any], args: Sequence[Any]) -> MLIRModule:
    """Lower ``fn`` for these arguments or templates to a StableHLO module with ``@main``."""
    templates = templates_of(tuple(args))
    with defn_errors():
        lowered = jax.jit(fn).lower(*abstract_tree(tuple(templates)))
    return MLIRModule(
        mlir_module=lowered.as_text(),
        output_container=templates_of(lowered.out_info),
        used_inputs=_kept_inputs(lowered),
        input_templates=tuple(jax.tree_util.tree_leaves(templates)),
    )
