"""``trace(fn, *args)``: the traced graph of a definition, printable node by node.

A :class:`Graph` wraps the jaxpr JAX traces (read through ``jax.make_jaxpr``)
with the input and output pytree structures. Values are numbered ``%0``,
``%1``, ... in order of definition: inputs first, then captured constants,
then each node's results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jcore

from .errors import defn_errors
from .template import Template, abstract_tree


def _aval_template(aval: Any) -> Template:
    return Template(aval.shape, aval.dtype)


def _aval_text(aval: Any) -> str:
    """``float32(4)``; a PRNG key type (no numpy dtype) as JAX prints it, ``key<fry>(3)``."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return f"{aval.dtype}{tuple(aval.shape)}"
    return str(_aval_template(aval))


def _format_param(value: Any) -> str:
    if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        jaxpr = value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value
        return f"<graph of {len(jaxpr.eqns)} nodes>"
    if isinstance(value, tuple) and value and isinstance(value[0], (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return "(" + ", ".join(_format_param(v) for v in value) + ")"
    if callable(value) and not isinstance(value, type):
        return f"<{getattr(value, '__name__', type(value).__name__)}>"
    return str(value)


class Graph:
    """A traced definition: the closed jaxpr plus the pytree structure of inputs and outputs."""

    __slots__ = ("closed_jaxpr", "in_tree", "out_tree", "name", "_names")

    def __init__(self, closed_jaxpr: jcore.ClosedJaxpr, in_tree: Any, out_tree: Any, name: str = "graph") -> None:
        self.closed_jaxpr = closed_jaxpr
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.name = name
        self._names: dict[Any, str] | None = None

    @property
    def jaxpr(self) -> jcore.Jaxpr:
        return self.closed_jaxpr.jaxpr

    @property
    def consts(self) -> list[Any]:
        return list(self.closed_jaxpr.consts)

    @property
    def input_templates(self) -> list[Template]:
        return [_aval_template(v.aval) for v in self.jaxpr.invars]

    @property
    def output_container(self) -> Any:
        leaves = [_aval_template(v.aval) for v in self.jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

    def names(self) -> dict[Any, str]:
        """``%N`` for every variable, in order of definition."""
        if self._names is None:
            names: dict[Any, str] = {}
            for var in [*self.jaxpr.invars, *self.jaxpr.constvars]:
                names[var] = f"%{len(names)}"
            for eqn in self.jaxpr.eqns:
                for var in eqn.outvars:
                    if not isinstance(var, jcore.DropVar):
                        names[var] = f"%{len(names)}"
            self._names = names
        return self._names

    def atom(self, atom: Any) -> str:
        """How one node input prints: ``%N`` for a variable, the value for a literal."""
        if isinstance(atom, jcore.Literal):
            return f"{atom.val}:{atom.aval.dtype.name}"  # type: ignore[attr-defined]  # a literal's aval is shaped
        return self.names()[atom]

    def node_line(self, eqn: jcore.JaxprEqn) -> str:
        """``%3 = exp %2 : float32(4)``, with parameters in brackets."""
        results = ", ".join("_" if isinstance(v, jcore.DropVar) else self.names()[v] for v in eqn.outvars)
        params = ", ".join(f"{k}={_format_param(v)}" for k, v in eqn.params.items() if v is not None)
        types = ", ".join(_aval_text(v.aval) for v in eqn.outvars)
        inputs = " ".join(self.atom(a) for a in eqn.invars)
        bracket = f"[{params}]" if params else ""
        if not eqn.outvars:  # run for its effect (a debug callback): nothing to name
            return f"{eqn.primitive.name}{bracket} {inputs}"
        return f"{results} = {eqn.primitive.name}{bracket} {inputs} : {types}"

    def lines(self) -> Iterator[str]:
        names = self.names()
        inputs = ", ".join(f"{names[v]}: {_aval_text(v.aval)}" for v in self.jaxpr.invars)
        yield f"graph {self.name}({inputs}) {{"
        for var in self.jaxpr.constvars:
            yield f"  {names[var]} = constant : {_aval_text(var.aval)}"
        for eqn in self.jaxpr.eqns:
            yield f"  {self.node_line(eqn)}"
        yield f"  return {', '.join(self.atom(v) for v in self.jaxpr.outvars)}"
        yield "}"

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.jaxpr.invars)} inputs, {len(self.jaxpr.eqns)} nodes>"


def trace(fn: Callable[..., Any], *args: Any) -> Graph:
    """Trace ``fn`` for these arguments or templates (pytrees allowed) into a :class:`Graph`."""
    abstract = abstract_tree(args)
    with defn_errors():
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
    in_tree = jax.tree_util.tree_structure(tuple(abstract))
    out_tree = jax.tree_util.tree_structure(out_shape)
    return Graph(closed, in_tree, out_tree, getattr(fn, "__name__", "graph"))


def graph_of_jaxpr(jaxpr: Any, name: str = "subgraph") -> Graph:
    """A :class:`Graph` for a sub-jaxpr found in a node's parameters (flat inputs and outputs)."""
    closed = jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(jaxpr, ())
    in_tree = jax.tree_util.tree_structure(tuple(range(len(closed.jaxpr.invars))))
    out_tree = jax.tree_util.tree_structure(list(range(len(closed.jaxpr.outvars))))
    return Graph(closed, in_tree, out_tree, name)


__all__ = ["Graph", "graph_of_jaxpr", "trace"]
