"""The Interpreter: run a Graph node by node with numpy (torch.fx's Interpreter).

Everything that does not depend on the input values is worked out once, when
the interpreter is built: each node's implementation from the table in
:mod:`.primitives`, the slot of every value, and after which node each
value is used for the last time. Running is then a loop over prepared nodes
that frees every value, inputs included, right after its last use.

With ``checks`` on (the option, or ``JITSERVE_CHECKS=1`` in the environment),
every result's shape and dtype kind is checked against what JAX inferred for
it, and a mismatch names the node: a wrong implementation cannot pass
unnoticed (the test suite runs this way).

``boxed_run(args_list)`` is the boxed calling convention: the interpreter
takes the arguments out of the caller's list and clears it, so that the
caller holds no reference and inputs can be freed early. ``run_node`` is the
hook subclasses override to trace, count or check each node.

When ``run_node`` is not overridden, the prepared nodes are also written out
as one straight-line Python function (as torch.fx's GraphModule does), with
the same calls, dtype checks and ``del`` after each value's last use: the same
semantics without the loop's per-node bookkeeping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from ...defaults import CHECKS_ENV
from ...errors import EvaluationError
from ...graph import Graph, graph_of_jaxpr, trace
from ...template import Template
from .primitives import MULTIPLE_RESULTS, PHYSICAL_RULES, PRIMITIVES, SUBGRAPH_PARAMS, bind_params, physical_shape_dtype


class Node:
    """One prepared node: its implementation, parameters, operand and result slots, and what to free after it."""

    __slots__ = ("index", "primitive", "impl", "params", "inputs", "outputs", "out_shapes", "out_dtypes", "free",
                 "multiple_results", "line")

    def __init__(self, index: int, primitive: str, impl: Any, params: dict[str, Any], inputs: list[int],
                 outputs: list[int | None], out_avals: list[tuple[tuple[int, ...], np.dtype]], line: str) -> None:
        self.index = index
        self.primitive = primitive
        self.impl = impl
        self.params = params
        self.inputs = inputs
        self.outputs = outputs
        self.out_shapes = [shape for shape, _ in out_avals]
        self.out_dtypes = [dtype for _, dtype in out_avals]
        self.free: list[int] = []
        self.multiple_results = primitive in MULTIPLE_RESULTS
        self.line = line

    def __str__(self) -> str:
        return self.line

    def __repr__(self) -> str:
        return f"<Node {self.line}>"

    def check(self, position: int, value: Any) -> None:
        """Raise if result ``position`` is not shaped as JAX inferred, or not of its dtype's kind."""
        shape, dtype = self.out_shapes[position], self.out_dtypes[position]
        got = np.asarray(value)
        if got.shape != shape or _kind(got.dtype) != _kind(dtype):
            raise ValueError(f"result {position} is {got.dtype}{list(got.shape)}, but JAX infers "
                             f"{dtype}{list(shape)} (the evaluator's {self.primitive!r} is wrong)")


def _kind(dtype: np.dtype) -> str:
    """b, i, u, f or c: bfloat16 and the other ml_dtypes floats count as f."""
    return "f" if jax.dtypes.issubdtype(dtype, np.floating) else dtype.kind


def checks_from_environment() -> bool:
    return os.environ.get(CHECKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _unsupported(primitive: str) -> NotImplementedError:
    return NotImplementedError(
        f"the evaluator has no implementation of primitive {primitive!r}; "
        f"add an entry for it to PRIMITIVES in jitserve/compilers/evaluator/primitives.py"
    )


class Interpreter:
    """Runs a :class:`Graph` with numpy, freeing each value after its last use."""

    def __init__(self, graph: Graph, *, free_after_last_use: bool = True, checks: bool | None = None) -> None:
        self.graph = graph
        self.free_after_last_use = free_after_last_use
        self.checks = checks_from_environment() if checks is None else checks
        jaxpr = graph.jaxpr
        slots: dict[Any, int] = {}
        initial: list[Any] = []

        def new_slot(value: Any = None) -> int:
            initial.append(value)
            return len(initial) - 1

        self._input_slots = [slots.setdefault(v, new_slot()) for v in jaxpr.invars]
        for var, const in zip(jaxpr.constvars, graph.consts):
            slots[var] = new_slot(np.asarray(const))
        fixed = set(range(len(self._input_slots), len(initial)))  # constants (and literals, below) stay

        def operand_slot(atom: Any) -> int:
            if isinstance(atom, jcore.Literal):
                slot = new_slot(np.asarray(atom.val, atom.aval.dtype))  # type: ignore[attr-defined]  # shaped
                fixed.add(slot)
                return slot
            return slots[atom]

        self.nodes: list[Node] = []
        for index, eqn in enumerate(jaxpr.eqns):
            name = eqn.primitive.name
            impl = PRIMITIVES.get(name)
            if impl is None:
                raise _unsupported(name)
            inputs = [operand_slot(a) for a in eqn.invars]
            outputs = [None if isinstance(v, jcore.DropVar) else slots.setdefault(v, new_slot()) for v in eqn.outvars]
            params = bind_params(name, impl, self._prepare_params(eqn))
            self.nodes.append(Node(index, name, impl, params, inputs, outputs,
                                   [physical_shape_dtype(v.aval) for v in eqn.outvars], graph.node_line(eqn)))
        self._output_slots = [operand_slot(a) for a in jaxpr.outvars]
        self._initial = initial
        self.output_templates = [Template(*physical_shape_dtype(v.aval)) for v in jaxpr.outvars]
        self._single_output = graph.out_tree.num_nodes == 1 and graph.out_tree.num_leaves == 1
        self._dead_inputs: list[int] = []
        if free_after_last_use:
            self._plan_frees(fixed)
        self._straight_line = self._generate() if type(self).run_node is Interpreter.run_node else None

    def _generate(self) -> Callable[[list[Any]], list[Any]]:
        """The nodes as one generated function ``run(args) -> outputs`` (clears ``args``)."""
        namespace: dict[str, Any] = {"asarray": np.asarray, "ndarray": np.ndarray, "EvaluationError": EvaluationError,
                                     "nodes": self.nodes}
        for slot, value in enumerate(self._initial):
            if value is not None:
                namespace[f"s{slot}"] = value
        dead = set(self._dead_inputs)
        lines = ["def run(args):"]
        lines += [f"    s{slot} = asarray(args[{position}])" for position, slot in enumerate(self._input_slots)
                  if slot not in dead]
        lines += ["    args.clear()", "    try:", "        k = -1"]
        for node in self.nodes:
            k = node.index
            namespace[f"f{k}"] = node.impl
            operands = ", ".join(f"s{slot}" for slot in node.inputs)
            if node.params:
                namespace[f"p{k}"] = node.params
                operands += f"{', ' if operands else ''}**p{k}"
            lines += [f"        k = {k}", f"        r = f{k}({operands})"]
            for position, output in enumerate(node.outputs):
                if output is None:
                    continue
                dtype = f"d{k}_{position}"
                namespace[dtype] = node.out_dtypes[position]
                value = f"r[{position}]" if node.multiple_results else "r"
                lines.append(f"        v = {value}")
                if self.checks:
                    lines.append(f"        nodes[{k}].check({position}, v)")
                lines.append(f"        s{output} = v if type(v) is ndarray and v.dtype == {dtype} "
                             f"else asarray(v, {dtype})")
            if node.free:
                lines.append(f"        del {', '.join(f's{slot}' for slot in node.free)}")
        lines += ["    except Exception as error:",
                  "        raise EvaluationError(f'While executing {nodes[k]}: {type(error).__name__}: {error}') "
                  "from error",
                  f"    return [{', '.join(f's{slot}' for slot in self._output_slots)}]"]
        exec(compile("\n".join(lines), f"<jitserve graph {self.graph.name}>", "exec"), namespace)
        return namespace["run"]

    def _prepare_params(self, eqn: Any) -> dict[str, Any]:
        """The node's parameters, with sub-graphs replaced by interpreters of the same class, and for PRNG key
        primitives an interpreter of JAX's definition on the keys' data as ``physical``."""
        primitive = eqn.primitive.name
        prepared = dict(eqn.params)
        for name in SUBGRAPH_PARAMS.get(primitive, ()):
            value = prepared[name]
            if isinstance(value, tuple):
                prepared[name] = tuple(
                    None if v is None else self._sub_interpreter(graph_of_jaxpr(v, f"{primitive}.{name}[{i}]"))
                    for i, v in enumerate(value))
            elif value is not None:
                prepared[name] = self._sub_interpreter(graph_of_jaxpr(value, f"{primitive}.{name}"))
        rule = PHYSICAL_RULES.get(primitive)
        if rule is not None:
            avals = [atom.aval for atom in eqn.invars]
            physical = rule(eqn.params, avals)
            templates = [Template(*physical_shape_dtype(aval)) for aval in avals]
            prepared["physical"] = self._sub_interpreter(trace(physical, *templates))
        return prepared

    def _sub_interpreter(self, graph: Graph) -> Interpreter:
        return type(self)(graph, free_after_last_use=self.free_after_last_use, checks=self.checks)

    def _plan_frees(self, fixed: set[int]) -> None:
        """After which node each value is used for the last time (once per graph; ``x + x`` counts once)."""
        keep = fixed | set(self._output_slots)
        last_use: dict[int, int] = {}
        for node in self.nodes:
            for slot in node.inputs:
                last_use[slot] = node.index
            for output in node.outputs:
                if output is not None:
                    last_use.setdefault(output, node.index)  # a result nobody reads dies at once
        for slot, index in last_use.items():
            if slot not in keep:
                self.nodes[index].free.append(slot)
        self._dead_inputs = [s for s in self._input_slots if s not in last_use and s not in keep]

    def run(self, *args: Any) -> Any:
        """Run on these arguments (the pytree structure the graph was traced with); returns the outputs."""
        return self.boxed_run(jax.tree_util.tree_flatten(args)[0])

    def boxed_run(self, args_list: list[Any]) -> Any:
        """Run on the flat arguments in ``args_list``, which is cleared; returns the output pytree."""
        outputs = self.run_flat(args_list)
        return outputs[0] if self._single_output else self.graph.out_tree.unflatten(outputs)

    def run_flat(self, args_list: list[Any]) -> list[Any]:
        """Run on flat arguments (the list is cleared) and return the flat outputs."""
        if len(args_list) != len(self._input_slots):
            raise TypeError(f"graph {self.graph.name} takes {len(self._input_slots)} inputs, got {len(args_list)}")
        if self._straight_line is not None:
            return self._straight_line(args_list)
        env = self._initial.copy()
        for position, slot in enumerate(self._input_slots):
            env[slot] = np.asarray(args_list[position])
        args_list.clear()
        for slot in self._dead_inputs:
            env[slot] = None
        run_node = self.run_node
        ndarray = np.ndarray
        for node in self.nodes:
            try:
                results = run_node(node, [env[slot] for slot in node.inputs])
            except Exception as error:
                raise EvaluationError(f"While executing {node}: {type(error).__name__}: {error}") from error
            for position, output in enumerate(node.outputs):
                if output is not None:
                    value, dtype = results[position], node.out_dtypes[position]
                    if self.checks:
                        try:
                            node.check(position, value)
                        except ValueError as error:
                            raise EvaluationError(f"While executing {node}: ValueError: {error}") from None
                    env[output] = value if type(value) is ndarray and value.dtype == dtype else np.asarray(value, dtype)
            value = results = None  # type: ignore[assignment]  # let go of this node's results now
            for slot in node.free:
                env[slot] = None
        return [env[slot] for slot in self._output_slots]

    def run_node(self, node: Node, args: list[Any]) -> list[Any]:
        """Run one node on its operand values; returns its results as a list. Override to customise."""
        out = node.impl(*args, **node.params) if node.params else node.impl(*args)
        return out if node.multiple_results else [out]
