"""``Serving``: a batch function, how it is compiled, and how batches are sized.

A serving holds the user's function and its batching configuration. Every
executed batch is zero-padded up to one of ``batch_sizes`` (the static shapes
compiled ahead of time; PopRT's behaviour with ``[batch_size]``) and the
padding rows are cut from the results. :meth:`Serving.run` executes inline in
the caller, any size, in chunks of at most ``batch_size``; a server
(:func:`jitserve.serve`) batches concurrent callers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import compilers
from ..batch import Batch, RowSignature
from ..defn import defn_errors, resolve_options
from ..errors import BatchError, OptionError, OutputShapeError
from ..template import Template, is_template, template_of
from .queue import BatchPolicy

OVERSIZE_MODES = ("split", "error")
ISOLATION_MODES = ("thread", "process")


def _default_batch_sizes(batch_size: int) -> list[int]:
    sizes = [1 << k for k in range(batch_size.bit_length()) if 1 << k < batch_size]
    return [*sizes, batch_size]


def _check_batch_sizes(batch_size: int, batch_sizes: Sequence[int] | None) -> list[int]:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise OptionError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_sizes is None:
        return _default_batch_sizes(batch_size)
    sizes = sorted(set(int(s) for s in batch_sizes))
    if not sizes or sizes[0] < 1 or sizes[-1] != batch_size:
        raise OptionError(
            f"batch_sizes must be positive and end at batch_size ({batch_size}), got {list(batch_sizes)}"
        )
    return sizes


class Executor:
    """One partition's executables: one per (padded batch size, row signature), compiled on first use."""

    def __init__(self, serving: "Serving", options: Mapping[str, Any], on_compile: Callable[[], None]) -> None:
        self.serving = serving
        self.options = dict(options)
        self._on_compile = on_compile
        self._compiled: dict[tuple[Any, ...], Callable[[Any], Any]] = {}
        self._lock = threading.Lock()

    def compiled(self, rows: int, tree: Any, row_signature: RowSignature) -> Callable[[Any], Any]:
        key = (rows, tree, row_signature)
        run = self._compiled.get(key)
        if run is None:
            with self._lock:
                run = self._compiled.get(key)
                if run is None:
                    run = self._compiled[key] = self._compile(rows, tree, row_signature)
        return run

    def _compile(self, rows: int, tree: Any, row_signature: RowSignature) -> Callable[[Any], Any]:
        serving = self.serving
        templates = jax.tree_util.tree_unflatten(tree, [Template((rows, *shape), dtype) for shape, dtype in row_signature])
        compiler = compilers.get(serving.compiler_name)
        with defn_errors():
            executable = compiler.compile(serving.fn, [templates], self.options)
        if compiler.compiles:
            self._on_compile()
        return executable.run

    def execute(self, batch: Batch) -> Any:
        """Run one batch (``batch.size`` rows padded by ``batch.pad``); outputs cut to the real rows, as numpy."""
        rows = batch.size + batch.pad
        run = self.compiled(rows, batch.tree, batch.rows)
        outputs = run(batch.materialize())
        return cut_rows(outputs, rows, batch.size)


def _owned_host_array(value: Any) -> np.ndarray:
    """A numpy copy of a device array (jax, or IREE's, whose host view may be reused by later calls):
    callers keep slices of the outputs."""
    to_host = getattr(value, "to_host", None)
    return np.array(to_host() if to_host is not None else value)


def cut_rows(outputs: Any, rows: int, keep: int) -> Any:
    """The first ``keep`` of the ``rows`` rows of every output, as host numpy arrays."""
    leaves, tree = jax.tree_util.tree_flatten(outputs)
    cut = []
    for leaf in leaves:
        array = leaf if type(leaf) is np.ndarray else _owned_host_array(leaf)
        if array.ndim == 0 or array.shape[0] != rows:
            raise OutputShapeError(
                f"the serving function must return batch-major outputs (axis 0 = the {rows} rows of the batch); "
                f"got an output of {template_of(array)}"
            )
        cut.append(array if keep == rows else array[:keep])
    return jax.tree_util.tree_unflatten(tree, cut)


def concatenate_outputs(parts: Sequence[Any]) -> Any:
    """Outputs of consecutive row ranges joined on axis 0 (the parts of a split request)."""
    if len(parts) == 1:
        return parts[0]
    flat = [jax.tree_util.tree_flatten(p) for p in parts]
    tree = flat[0][1]
    return jax.tree_util.tree_unflatten(tree, [np.concatenate(leaves) for leaves in zip(*(f[0] for f in flat))])


class Serving:
    """A function served with dynamic batching; see :func:`jitserve.serve` for the server."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        batch_size: int = 1,
        batch_timeout: float = 0.1,
        batch_sizes: Sequence[int] | None = None,
        oversize: str = "split",
        partitions: int = 1,
        max_queue: int | None = None,
        input_template: Any = None,
        preprocess: Callable[[Any], Batch] | None = None,
        postprocess: Callable[[Any], Any] | None = None,
        compiler: str | None = None,
        isolation: str | None = None,
        **compiler_options: Any,
    ) -> None:
        self._arguments = {k: v for k, v in locals().items() if k not in ("self", "compiler_options", "__class__")}
        self._arguments.update(compiler_options)
        self.fn = fn
        self.batch_sizes = _check_batch_sizes(batch_size, batch_sizes)
        self.batch_size = batch_size
        if batch_timeout < 0:
            raise OptionError(f"batch_timeout must be >= 0 seconds, got {batch_timeout!r}")
        self.batch_timeout = float(batch_timeout)
        if oversize not in OVERSIZE_MODES:
            raise OptionError(f"oversize must be one of {', '.join(OVERSIZE_MODES)}, got {oversize!r}")
        self.oversize = oversize
        if not isinstance(partitions, int) or partitions < 1:
            raise OptionError(f"partitions must be a positive integer, got {partitions!r}")
        self.partitions = partitions
        if max_queue is not None and max_queue < 1:
            raise OptionError(f"max_queue must be a positive number of rows or None, got {max_queue!r}")
        self.max_queue = max_queue
        self.input_template = (
            None if input_template is None
            else jax.tree_util.tree_map(template_of, input_template, is_leaf=is_template)
        )
        self.preprocess = preprocess
        self.postprocess = postprocess
        chosen, self.compiler_options = resolve_options(
            {**({"compiler": compiler} if compiler else {}), **compiler_options})
        self.compiler_name = chosen.name
        if isolation is not None and isolation not in ISOLATION_MODES:
            raise OptionError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, got {isolation!r}")
        self.isolation = isolation or chosen.default_isolation
        self._inline: Executor | None = None
        self._inline_lock = threading.Lock()

    def replace(self, **changes: Any) -> "Serving":
        """A new Serving with some arguments changed (a new ``batch_size`` drops explicit ``batch_sizes``)."""
        arguments = {**self._arguments, **changes}
        if "batch_size" in changes and "batch_sizes" not in changes:
            arguments["batch_sizes"] = None
        return Serving(**arguments)

    @property
    def policy(self) -> BatchPolicy:
        """How a server of this serving forms batches (see ``queue.py``)."""
        return BatchPolicy(self.batch_size, tuple(self.batch_sizes), self.batch_timeout, self.max_queue)

    @property
    def compiles(self) -> bool:
        """Whether the serving's compiler compiles anything (``eager`` does not: no warm-up, no compiles)."""
        return compilers.get(self.compiler_name).compiles

    def partition_options(self) -> list[dict[str, Any]]:
        """One option set per partition: one per device where there are several, cycled to ``partitions``."""
        per_device = compilers.get(self.compiler_name).partitions(self.compiler_options)
        return [per_device[i % len(per_device)] for i in range(self.partitions)]

    def template_signature(self) -> tuple[Any, RowSignature] | None:
        """The (structure, per-row signature) batches shaped like ``input_template`` have, or None."""
        if self.input_template is None:
            return None
        leaves, tree = jax.tree_util.tree_flatten(self.input_template)
        return tree, tuple((t.shape, t.dtype) for t in leaves)

    def to_batch(self, value: Any) -> Batch:
        """The caller's input as a Batch: through ``preprocess`` when given, else it must be one."""
        batch = self.preprocess(value) if self.preprocess is not None else value
        if not isinstance(batch, Batch):
            raise BatchError(
                f"expected a jitserve.Batch (build one with Batch.stack or Batch.concatenate), "
                f"got {type(batch).__name__}"
            )
        if batch.size == 0:
            raise BatchError("the batch holds no rows; send at least one")
        return batch

    def finish(self, outputs: Any) -> Any:
        return self.postprocess(outputs) if self.postprocess is not None else outputs

    def run(self, value: Any) -> Any:
        """Run inline in the caller: any number of rows, in padded chunks of at most ``batch_size``."""
        batch = self.to_batch(value)
        if self._inline is None:
            with self._inline_lock:
                if self._inline is None:
                    self._inline = Executor(self, self.partition_options()[0], lambda: None)
        parts = []
        for chunk in batch.chunks(self.batch_size):
            parts.append(self._inline.execute(chunk.pad_to(self.policy.padded_size(chunk.size))))
        return self.finish(concatenate_outputs(parts))

    def __getstate__(self) -> dict[str, Any]:
        """What travels to another process (a cluster replica or client): the configuration, not the
        executables compiled here."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_inline", "_inline_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._inline = None
        self._inline_lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"Serving({getattr(self.fn, '__name__', self.fn)!r}, batch_size={self.batch_size}, "
                f"batch_sizes={self.batch_sizes}, compiler={self.compiler_name!r})")
