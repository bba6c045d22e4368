"""``Batch``: rows from one or many callers, gathered lazily (``Nx.Batch``).

A batch is a list of chunks, each a pytree of arrays whose axis 0 holds rows.
Nothing is copied until :meth:`Batch.materialize` writes the rows, padded to a
compiled size, into one array per leaf. As with ``Nx.Batch``, ``stack`` and
``concatenate`` build a new batch when called on the class and add to a batch
when called on one (``Batch.stack([a]).stack([b])`` holds 2 rows); ``pad(n)``
adds n zero rows, ``merge`` joins batches, ``key`` names the batch key. Every row of a batch has the same
structure, per-row shapes and dtypes (its *signature*, kept as plain tuples so
that hashing it on the hot path is cheap); with the user's ``key`` that
signature decides which batches may share an execution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from .errors import BatchError
from .template import Template


class _Chunk:
    """Rows ``start:stop`` of a pytree of arrays (``stacked``: one entry without a row axis yet)."""

    __slots__ = ("leaves", "start", "stop", "stacked")

    def __init__(self, leaves: list[np.ndarray], start: int, stop: int, stacked: bool) -> None:
        self.leaves = leaves
        self.start = start
        self.stop = stop
        self.stacked = stacked

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def cut(self, start: int, stop: int) -> _Chunk:
        return _Chunk(self.leaves, self.start + start, self.start + stop, self.stacked)

    def view(self, leaf: int) -> np.ndarray:
        """This chunk's rows of one leaf, with the row axis, as a view (no copy)."""
        array = self.leaves[leaf]
        return array[None] if self.stacked else array[self.start:self.stop]


RowSignature = tuple[tuple[tuple[int, ...], np.dtype], ...]  # (per-row shape, dtype) of each leaf

INCOMPATIBLE = "cannot add to batch due to incompatible tensors/containers"  # Nx.Batch's words


class _NewOrAdd:
    """A builder that makes a new batch on the class (``Batch.stack(entries)``) and adds to the batch on an
    instance (``batch.stack(entries)``), as ``Nx.Batch.stack(batch \\ new(), entries)`` does."""

    def __init__(self, build: Callable[..., Batch]) -> None:
        self.build = build
        self.on_class: dict[type[Batch], Callable[..., Batch]] = {}  # owner -> its builder, made once
        functools.update_wrapper(self, build)  # type: ignore[arg-type]

    def __get__(self, instance: Batch | None, owner: type[Batch]) -> Callable[..., Batch]:
        if instance is not None:
            return functools.partial(self.build, owner, instance)
        built = self.on_class.get(owner)
        if built is None:
            built = self.on_class[owner] = functools.partial(self.build, owner, None)
        return built


def _describe(rows: RowSignature) -> str:
    return ", ".join(str(Template(shape, dtype)) for shape, dtype in rows)


_ONE_LEAF = jax.tree_util.tree_structure(0)  # the structure of an entry that is a single array


def _leaves_and_signature(entry: Any, stacked: bool) -> tuple[list[np.ndarray], Any, RowSignature, int]:
    if type(entry) is np.ndarray and entry.ndim and not stacked:  # the common case, without pytree work
        return [entry], _ONE_LEAF, ((entry.shape[1:], entry.dtype),), entry.shape[0]
    leaves, tree = jax.tree_util.tree_flatten(entry)
    if not leaves:
        raise BatchError("an entry must hold at least one array; got an empty structure")
    arrays = [np.asarray(leaf) for leaf in leaves]
    if stacked:
        return arrays, tree, tuple([(a.shape, a.dtype) for a in arrays]), 1
    if any(a.ndim == 0 for a in arrays):
        raise BatchError("Batch.concatenate needs arrays with a row axis (axis 0); got a scalar. "
                         "Use Batch.stack for single entries")
    rows = {a.shape[0] for a in arrays}
    if len(rows) != 1:
        raise BatchError(f"the arrays of one entry must have the same number of rows (axis 0); got {sorted(rows)}")
    return arrays, tree, tuple([(a.shape[1:], a.dtype) for a in arrays]), rows.pop()


class Batch:
    """Rows gathered for one execution: ``Batch.stack`` / ``Batch.concatenate``, then ``size`` and ``pad``."""

    __slots__ = ("_chunks", "tree", "row_signature", "size", "padding", "user_key")

    def __init__(self, chunks: list[_Chunk], tree: Any, row_signature: RowSignature, user_key: Any = None,
                 padding: int = 0) -> None:
        self._chunks = chunks
        self.tree = tree
        self.row_signature = row_signature  # each leaf's per-row shape and dtype
        self.size = chunks[0].rows if len(chunks) == 1 else sum([c.rows for c in chunks])
        self.padding = padding  # zero rows added when materialized
        self.user_key = user_key

    @classmethod
    def _build(cls, entries: Iterable[Any], stacked: bool) -> Batch:
        chunks: list[_Chunk] = []
        tree: Any = None
        templates: tuple[tuple[tuple[int, ...], np.dtype], ...] = ()
        for position, entry in enumerate(entries):
            leaves, entry_tree, entry_templates, rows = _leaves_and_signature(entry, stacked)
            if tree is None:
                tree, templates = entry_tree, entry_templates
            elif entry_tree != tree:
                raise BatchError(f"{INCOMPATIBLE}: entry {position} has structure {entry_tree}, but entry 0 has {tree}")
            elif entry_templates != templates:
                raise BatchError(
                    f"{INCOMPATIBLE}: entry {position} has rows of {_describe(entry_templates)}, but entry 0 has "
                    f"rows of {_describe(templates)}; entries of a batch must agree in per-row shape and dtype"
                )
            if rows:
                chunks.append(_Chunk(leaves, 0, rows, stacked))
        if tree is None:
            raise BatchError("a batch needs at least one entry; got none")
        return cls(chunks, tree, templates)

    @classmethod
    def _add(cls, batch: Batch | None, entries: Sequence[Any], stacked: bool) -> Batch:
        if batch is None and not stacked and type(entries) is list and len(entries) == 1:
            entry = entries[0]  # the common case, one array with rows (a caller's request), without pytree work
            if type(entry) is np.ndarray and entry.ndim and entry.shape[0]:
                return cls([_Chunk([entry], 0, entry.shape[0], False)], _ONE_LEAF, ((entry.shape[1:], entry.dtype),))
        added = cls._build(entries, stacked)
        if batch is None:
            return added
        if (added.tree, added.row_signature) != (batch.tree, batch.row_signature):
            raise BatchError(f"{INCOMPATIBLE}: the batch has rows of {_describe(batch.row_signature)}"
                             f"{'' if added.tree == batch.tree else f' (structure {batch.tree})'}, but the entries "
                             f"have rows of {_describe(added.row_signature)}"
                             f"{'' if added.tree == batch.tree else f' (structure {added.tree})'}")
        return cls(batch._chunks + added._chunks, batch.tree, batch.row_signature, batch.user_key, batch.padding)

    @_NewOrAdd
    def stack(cls, batch: Batch | None, entries: Sequence[Any]) -> Batch:  # noqa: N805 - _NewOrAdd binds it
        """Each entry (an array, or a tuple/dict of arrays) becomes one row: of a new batch (``Batch.stack``),
        or added after the rows of this one (``batch.stack``)."""
        return cls._add(batch, entries, stacked=True)

    @_NewOrAdd
    def concatenate(cls, batch: Batch | None, entries: Sequence[Any]) -> Batch:  # noqa: N805 - _NewOrAdd binds it
        """Each entry brings the rows on its axis 0: to a new batch, or after the rows of this one."""
        return cls._add(batch, entries, stacked=False)

    @classmethod
    def merge(cls, batches: Sequence[Batch]) -> Batch:
        """One batch holding the rows of all of ``batches``, in order; their padding adds up (Nx.Batch.merge)."""
        if not batches:
            raise BatchError("Batch.merge needs at least one batch; got none")
        first = batches[0]
        for position, other in enumerate(batches[1:], start=1):
            if other.user_key != first.user_key:
                raise BatchError(f"cannot merge batches with different keys: batch {position} has key "
                                 f"{other.user_key!r}, but batch 0 has {first.user_key!r}")
            if (other.tree, other.row_signature) != (first.tree, first.row_signature):
                raise BatchError(f"cannot merge batches due to incompatible templates: batch {position} has rows "
                                 f"of {_describe(other.row_signature)}, but batch 0 has rows of "
                                 f"{_describe(first.row_signature)}")
        merged = cls.join(batches)
        merged.padding = sum(b.padding for b in batches)
        return merged

    @classmethod
    def join(cls, batches: Sequence[Batch]) -> Batch:
        """``merge`` for batches already known to share one signature (a server queue's), unchecked, unpadded."""
        first = batches[0]
        return cls([c for b in batches for c in b._chunks], first.tree, first.row_signature, first.user_key)

    def key(self, key: Any) -> Batch:
        """The same rows under batch key ``key``: batches with different keys never share an execution."""
        return Batch(self._chunks, self.tree, self.row_signature, key, self.padding)

    def pad(self, rows: int) -> Batch:
        """The same rows with ``rows`` zero rows added at the end when materialized (``Nx.Batch.pad``)."""
        if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 0:
            raise BatchError(f"Batch.pad takes a number of rows >= 0, got {rows!r}")
        return Batch(self._chunks, self.tree, self.row_signature, self.user_key, int(rows))

    @property
    def signature(self) -> tuple[Any, ...]:
        """What decides which rows may share an execution: key, structure, per-row shapes and dtypes."""
        return (self.user_key, self.tree, self.row_signature)

    def split(self, rows: int) -> tuple[Batch, Batch]:
        """The first ``rows`` rows and the rest (either may be empty)."""
        if rows < 0:
            raise BatchError(f"cannot split at a negative row count ({rows})")
        head: list[_Chunk] = []
        tail: list[_Chunk] = []
        left = rows
        for chunk in self._chunks:
            if left >= chunk.rows:
                head.append(chunk)
                left -= chunk.rows
            elif left > 0:
                head.append(chunk.cut(0, left))
                tail.append(chunk.cut(left, chunk.rows))
                left = 0
            else:
                tail.append(chunk)
        make = lambda chunks: Batch(chunks, self.tree, self.row_signature, self.user_key)  # noqa: E731
        return make(head), make(tail)

    def chunks(self, rows: int) -> list[Batch]:
        """Consecutive batches of at most ``rows`` rows each."""
        parts = []
        rest = self
        while rest.size > rows:
            part, rest = rest.split(rows)
            parts.append(part)
        parts.append(rest)
        return parts

    def pad_to(self, rows: int) -> Batch:
        """The same rows, to be zero-padded to ``rows`` rows in all when materialized."""
        if rows < self.size:
            raise BatchError(f"cannot pad a batch of {self.size} rows down to {rows}")
        return self.pad(rows - self.size)

    def given(self) -> Any:
        """The rows as the one entry they came in holds them, without a copy: when the batch is one whole
        entry of C-contiguous arrays with a row axis, unpadded (a lone request's batch); else None."""
        if len(self._chunks) != 1 or self.padding:
            return None
        chunk = self._chunks[0]
        leaves = chunk.leaves
        if chunk.stacked or chunk.start or chunk.stop != leaves[0].shape[0] or not all(
                leaf.flags.c_contiguous for leaf in leaves):
            return None
        return leaves[0] if self.tree is _ONE_LEAF else jax.tree_util.tree_unflatten(self.tree, leaves)

    def materialize(self, into: Callable[[int, tuple[int, ...], np.dtype], np.ndarray] | None = None) -> Any:
        """The rows as a pytree of arrays, zero-padded by ``padding`` rows: one new array per leaf, or the
        array ``into(leaf, shape, dtype)`` gives for it (a buffer its caller reuses from batch to batch)."""
        total = self.size + self.padding
        outs = []
        for leaf, (shape, dtype) in enumerate(self.row_signature):
            out = np.empty((total, *shape), dtype) if into is None else into(leaf, (total, *shape), dtype)
            np.concatenate([chunk.view(leaf) for chunk in self._chunks], out=out[:self.size])
            out[self.size:] = 0
            outs.append(out)
        return jax.tree_util.tree_unflatten(self.tree, outs)

    def __repr__(self) -> str:
        key = "" if self.user_key is None else f", key: {self.user_key!r}"
        return f"#Batch<size: {self.size}, pad: {self.padding}{key}, rows: {_describe(self.row_signature)}>"

