"""Weights packed into few arrays: how a serving's or a generation's weights travel to its compiled code.

Each array a compiled program takes costs the host time on every call, in
JAX's dispatch and in XLA's runtime, whatever its size: about 0.6 us each on
this project's 2-core CPU (``jax.jit`` of a dict of 148 small arrays: 115 us
per call, against 25 us for 2). Where the host paces the work, as it does a
small model's decode step on a GPU (GPT-2's step: 0.54 ms of the host
launching it, 0.63 ms in all, on an H200), that is a cost per step. A
:class:`PackedLayout` lays the weights' vectors and scalars (biases, norm
scales: up to :data:`PACKED_ELEMENTS` elements each) end to end in one flat
array per dtype, and passes the matrices as they are, so that a program
takes few arrays (GPT-2: 51 for 148 weights); inside the program,
:meth:`PackedLayout.unpack` cuts the tree back out with static slices, which
XLA fuses into their consumers (a bias add reads its slice where it lies).
Matrices are not packed, however small: a slice that feeds a matrix product
is copied into a buffer of its own first, at every call.

A matrix the program only ever reads transposed (``x @ w.T``, as every
torch ``Linear`` weight is read: (out, in)) travels transposed, and
:meth:`PackedLayout.unpack` gives back ``w.T`` of it, which XLA folds into the
product: otherwise XLA's CPU matrix-vector product (a decode step of one
sequence) copies the whole matrix into the other layout at every call, and
the step reads its weights three times instead of once (see
:func:`transposed_reads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .template import Template, is_template

PACKED_ELEMENTS = 1 << 16  # vectors of at most this many elements share one array per dtype


class PackedLayout:
    """Where each leaf of a weights tree (given as its templates) lies among the packed arrays: leaf ``i``
    is ``arrays[place[i][0]]``, whole, or its elements ``[start, start + size)`` when it was packed;
    ``transposed``: the matrices (leaf indices) that travel transposed."""

    def __init__(self, template: Any, transposed: Iterable[int] = ()) -> None:
        leaves, self.tree = jax.tree_util.tree_flatten(template, is_leaf=is_template)
        self.leaf_templates: list[Template] = leaves
        self.transposed = frozenset(transposed)
        self.templates: list[Template] = []  # of the packed arrays, in the order the program takes them
        self.place: list[tuple[int, int | None]] = []
        ends: dict[np.dtype, int] = {}  # per dtype packed: elements so far
        packs: dict[np.dtype, int] = {}  # per dtype packed: its array's position
        for index, leaf in enumerate(leaves):
            size = math.prod(leaf.shape)
            if len(leaf.shape) > 1 or size > PACKED_ELEMENTS or leaf.weak_type:  # a Python scalar stays weak
                self.place.append((len(self.templates), None))
                self.templates.append(Template(leaf.shape[::-1], leaf.dtype) if index in self.transposed else leaf)
                continue
            if leaf.dtype not in packs:
                packs[leaf.dtype] = len(self.templates)
                self.templates.append(leaf)  # a stand-in until every leaf of the dtype is counted
            self.place.append((packs[leaf.dtype], ends.get(leaf.dtype, 0)))
            ends[leaf.dtype] = ends.get(leaf.dtype, 0) + size
        for dtype, position in packs.items():
            self.templates[position] = Template((ends[dtype],), dtype)

    def pack(self, params: Any) -> list[Any]:
        """The arrays of ``params`` (shaped as the template) as the program takes them: the packed ones new,
        on the host; the others as given (a memory-mapped matrix stays mapped, not read), or transposed (a
        view)."""
        leaves = jax.tree_util.tree_leaves(params)
        arrays: list[Any] = [None] * len(self.templates)
        parts: dict[int, list[np.ndarray]] = {}
        for index, (leaf, (position, start)) in enumerate(zip(leaves, self.place)):
            if start is None:
                arrays[position] = leaf.T if index in self.transposed else leaf
            else:
                parts.setdefault(position, []).append(np.asarray(leaf).reshape(-1))
        for position, pieces in parts.items():
            arrays[position] = np.concatenate(pieces).astype(self.templates[position].dtype, copy=False)
        return arrays

    def unpack(self, arrays: Any) -> Any:
        """The weights tree from the packed arrays (traced inside a program, or numpy as written)."""
        leaves = []
        for index, (template, (position, start)) in enumerate(zip(self.leaf_templates, self.place)):
            array = arrays[position]
            if start is not None:
                array = array[start:start + math.prod(template.shape)].reshape(template.shape)
            leaves.append(array.T if index in self.transposed else array)
        return jax.tree_util.tree_unflatten(self.tree, leaves)

    def taking_packed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(params, *rest)`` as a function of the packed arrays in place of ``params``."""
        return lambda arrays, *rest: fn(self.unpack(arrays), *rest)


def transposed_reads(fn: Callable[..., Any], params_template: Any, *rest: Any) -> list[int]:
    """The matrices of ``params_template`` (their leaf indices) that ``fn(params, *rest)`` reads only
    transposed, each use a (1, 0) ``transpose`` at the top of its trace: those a :class:`PackedLayout` may
    keep transposed. ``rest``: templates of the other arguments. A matrix read any other way, or inside a
    nested transformation's own trace, is kept as it is (the layout is then only slower, never wrong)."""
    leaves = jax.tree_util.tree_leaves(params_template, is_leaf=is_template)
    abstract = jax.tree_util.tree_map(lambda t: t.abstract(), (params_template, *rest), is_leaf=is_template)
    jaxpr = jax.make_jaxpr(fn)(*abstract).jaxpr
    inputs = {id(var): index for index, var in enumerate(jaxpr.invars[:len(leaves)])}
    only_transposed = {index for index, leaf in enumerate(leaves) if len(leaf.shape) == 2}
    used: set[int] = set()
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            index = inputs.get(id(var))
            if index is None:
                continue
            used.add(index)
            if eqn.primitive.name != "transpose" or tuple(eqn.params["permutation"]) != (1, 0):
                only_transposed.discard(index)
    only_transposed -= {inputs[id(var)] for var in jaxpr.outvars if id(var) in inputs}
    return sorted(only_transposed & used)
