"""The ``eager`` compiler: the function called as written, nothing compiled.

For servings whose function is not traceable by JAX (plain numpy, a call into
another library) or for debugging: batching, padding and the network fronts
work as with any compiler. It compiles nothing, so it counts no compiles, and
its output shapes come from calling the function on zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from ..template import is_template
from .base import Compiler, Device, Executable, flat_templates


class EagerCompiler(Compiler):
    name = "eager"
    compiles = False

    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                donate: Sequence[int] = ()) -> Executable:
        flat, tree = flat_templates(templates)
        return Executable(fn, flat, tree, None)

    def dispatcher(self, fn: Callable[..., Any], options: Mapping[str, Any],
                   on_compile: Callable[[], None]) -> Callable[..., Any]:
        return fn

    def output_shapes(self, fn: Callable[..., Any], templates: Sequence[Any]) -> Any:
        zeros = jax.tree_util.tree_map(lambda t: t.zeros(), tuple(templates), is_leaf=is_template)
        return fn(*zeros)

    def devices(self) -> list[Device]:
        return [Device(compiler=self.name, driver="cpu", id=0, uri="eager:cpu:0",
                       description="the function called as written")]
