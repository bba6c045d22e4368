"""The ``evaluator`` compiler: trace to a Graph and interpret it with numpy.

No XLA: each node runs through the table in :mod:`.primitives`, and
values are freed after their last use. It is the reference to debug and
instrument a definition with (subclass :class:`jitserve.Interpreter`).
Option ``free_after_last_use`` (default True) keeps every value alive when
False, to compare peak memory; ``checks`` (default: ``JITSERVE_CHECKS`` in the
environment) checks every node's results against the shapes and dtypes JAX
inferred.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...graph import trace
from ..base import Compiler, Device, Executable, flat_templates
from .interpreter import Interpreter


class EvaluatorCompiler(Compiler):
    name = "evaluator"
    pages = True
    options = frozenset({"device", "free_after_last_use", "checks"})

    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                donate: Sequence[int] = ()) -> Executable:
        graph = trace(fn, *templates)
        interpreter = Interpreter(graph, free_after_last_use=options.get("free_after_last_use", True),
                                  checks=options.get("checks"))
        flat, tree = flat_templates(templates)
        return Executable(interpreter.run, flat, tree, graph.output_container)

    def devices(self) -> list[Device]:
        return [Device(compiler=self.name, driver="cpu", id=0, uri="evaluator:cpu:0", description="numpy on the host")]
