"""The ``xla`` compiler: ``jax.jit(...).lower(...).compile()`` with device placement.

``jit`` dispatch goes straight to ``jax.jit``'s C++ fast path, which already
keys its cache on shapes and dtypes; jitserve only counts the traces. The
persistent compile cache is JAX's own (``jax_compilation_cache_dir``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from ..errors import OptionError
from ..template import Template, abstract_tree, template_of
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

    def _jit(self, fn: Callable[..., Any], options: Mapping[str, Any]) -> Any:
        enable_persistent_cache(options.get("cache_dir"))
        device = options.get("device")
        if device is None:
            return jax.jit(fn)
        sharding = SingleDeviceSharding(resolve_device(device))
        return jax.jit(fn, in_shardings=sharding, out_shardings=sharding)

    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any]) -> Executable:
        compiled = self._jit(fn, options).lower(*abstract_tree(tuple(templates))).compile()
        flat, tree = flat_templates(templates)
        return Executable(compiled, flat, tree, _output_container(compiled.out_info))

    def dispatcher(
        self, fn: Callable[..., Any], options: Mapping[str, Any], on_compile: Callable[[], None]
    ) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            on_compile()
            return fn(*args)

        return self._jit(traced, options)

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


def lower(fn: Callable[..., Any], templates: Sequence[Any | Template]) -> Any:
    """The ``jax.stages.Lowered`` of ``fn`` for these templates (used by ``to_mlir``)."""
    return jax.jit(fn).lower(*abstract_tree(tuple(templates)))
