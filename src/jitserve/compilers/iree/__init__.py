"""The ``iree`` compiler: lower to StableHLO, compile with IREE, run on an IREE device.

Options: ``iree_compiler_flags`` (default: the target backend that fits the
device, StableHLO input, the host CPU for llvm-cpu), ``iree_runtime_options``
(``{"device": Device or URI}``; ``device`` also works on its own), default
``local-task://``. Only the inputs the module uses are passed to it. Results
are IREE DeviceArrays (``np.asarray`` turns them into numpy arrays).

What IREE compiles is the definition made explicit by
:mod:`.explicit` (in-range gathers and scatters, stable
sorts), so that its answers are XLA's; flags that would change a function's
signature (demoting f64 to f32) are refused rather than followed silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ...errors import CompileError
from ...template import Template, host_array
from ..base import Compiler, Device, Executable, flat_templates
from ..xla import to_mlir
from . import runtime as iree
from .explicit import explicit


def _device(options: Mapping[str, Any]) -> Any:
    runtime = options.get("iree_runtime_options") or {}
    return runtime.get("device", options.get("device"))


def _check_signature(compiled: list[Template | None], wanted: list[Template], flags: tuple[str, ...]) -> None:
    """The module must take what the definition takes: no input type changed by a flag."""
    for position, (got, want) in enumerate(zip(compiled, wanted)):
        if got is not None and got != want:
            raise CompileError(f"IREE compiled input {position} as {got}, but the definition takes {want}: a flag "
                               f"changed the function's types (flags: {list(flags)}); jitserve does not change "
                               f"dtypes silently: drop --iree-input-demote-* or pass inputs of the compiled type")


class IreeCompiler(Compiler):
    name = "iree"
    options = frozenset({"device", "iree_compiler_flags", "iree_runtime_options"})

    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                donate: Sequence[int] = ()) -> Executable:
        device = _device(options)
        lowered = to_mlir(explicit(fn, donate), list(templates))
        flags = options.get("iree_compiler_flags") or iree.default_flags(device)
        module = iree.compile(lowered.mlir_module, flags, lowered.output_container, options.get("cache_dir"))
        invoke = module.function(device)
        used = lowered.used_inputs
        _check_signature(module.input_templates(), [lowered.input_templates[i] for i in used], module.flags)
        dtypes = [lowered.input_templates[i].dtype for i in used]
        out_tree: Any = jax.tree_util.tree_structure(lowered.output_container)  # jaxlib's PyTreeDef
        flatten = jax.tree_util.tree_flatten

        def run(*args: Any) -> Any:
            leaves = flatten(args)[0]
            inputs = [x if hasattr(x, "shape") else np.asarray(x, dt)
                      for x, dt in zip([leaves[i] for i in used], dtypes)]
            out = iree.invoke_checked(invoke, inputs, "main")
            return out_tree.unflatten(out if isinstance(out, tuple) else (out,))

        flat, tree = flat_templates(templates)
        return Executable(run, flat, tree, lowered.output_container)

    def place(self, tree: Any, options: Mapping[str, Any]) -> Any:
        device = _device(options)
        return jax.tree_util.tree_map(lambda leaf: iree.to_device(host_array(leaf), device), tree)

    def devices(self) -> list[Device]:
        return [device for driver in iree.list_drivers() for device in iree.list_devices(driver)]

    def partitions(self, options: Mapping[str, Any]) -> list[dict[str, Any]]:
        if _device(options) is not None:
            return [dict(options)]
        return [{**options, "device": device} for device in iree.list_devices(iree.DEFAULT_DRIVER)] or [dict(options)]
