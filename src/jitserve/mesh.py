"""A generation's arrays over several XLA devices (tensor parallel): where each weight and each part of a
sequence's decode state lies on a ``jax.sharding.Mesh``.

A :class:`MeshPlacement` says it (``from_pretrained(..., devices=N)`` makes one per family); a
:class:`MeshLayout`, made by the generation's programs, places the weights so that each device holds its
share only (a model larger than one device's memory serves) and gives the shardings each compiled program
takes and returns (:meth:`~jitserve.compilers.base.Compiler.compile_sharded`); XLA partitions the program
and adds the collectives. The weights travel packed as on one device (:class:`~jitserve.packed.PackedLayout`):
each matrix in an array of its own, split as its spec says, the packed vectors (biases, norm scales)
replicated, as small as they are. A program's other arrays (tokens, lengths, sampling options, logits)
are replicated."""

from __future__ import annotations

import itertools
from typing import Any, cast

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import OptionError
from .packed import PackedLayout

WEIGHTS = "weights"  # a program's role for an argument: the packed weights
STATE = "state"  # a tree of decode state rows stacked on one leading axis (the slots, or the prompts)


class MeshPlacement:
    """Where a generation's weights and decode state lie on ``mesh``: ``weights``, a tree shaped like the
    weights with a ``PartitionSpec`` per weight; ``state``, a tree shaped like one prompt's state row (what
    ``prefill`` returns first) with a ``PartitionSpec`` per leaf."""

    def __init__(self, mesh: Mesh, weights: Any, state: Any) -> None:
        self.mesh = mesh
        self.weights = weights
        self.state = state

    def __repr__(self) -> str:
        return f"MeshPlacement({dict(self.mesh.shape)}, {len(jax.tree_util.tree_leaves(self.weights))} weights)"


class MeshLayout:
    """A :class:`MeshPlacement` for weights packed as ``layout`` packs them: where each packed array lies (a
    weight of its own as its spec says, a pack replicated), and the shardings of a program's arrays."""

    def __init__(self, placement: MeshPlacement, layout: PackedLayout) -> None:
        self.placement = placement
        self.replicated = NamedSharding(placement.mesh, PartitionSpec())
        specs, tree = jax.tree_util.tree_flatten(placement.weights)
        if cast(Any, tree) != layout.tree:
            raise OptionError(f"the mesh placement's weights tree {tree} is not shaped like the generation's "
                              f"weights, {layout.tree}")
        self.weights = [self.replicated] * len(layout.templates)
        for index, (spec, (position, start)) in enumerate(zip(specs, layout.place)):
            if index in layout.transposed:  # the matrix travels transposed: so do its axes' roles
                spec = PartitionSpec(*reversed((*spec, None, None)[:2]))
            if start is None:
                self.weights[position] = NamedSharding(placement.mesh, spec)
        self.state = jax.tree_util.tree_map(lambda spec: NamedSharding(placement.mesh, PartitionSpec(None, *spec)),
                                            placement.state)

    def place(self, arrays: list[Any]) -> list[Any]:
        """The packed weights on the mesh, each device given its share only, copied now."""
        return list(jax.block_until_ready(jax.device_put(arrays, self.weights)))

    def shardings(self, roles: Any, count: int | None = None) -> Any:
        """The shardings of a program's arguments or results (a prefix of their tree) that ``roles`` name:
        :data:`WEIGHTS`, :data:`STATE`, or None (replicated); a tuple of roles for a tuple, padded with None
        to ``count`` items."""
        if isinstance(roles, tuple):
            return tuple(self.shardings(role) for role, _ in itertools.zip_longest(roles, range(count or len(roles))))
        return {WEIGHTS: self.weights, STATE: self.state}.get(roles, self.replicated)
