"""``Serving``: a batch function, how it is compiled, and how batches are sized.

A serving holds the user's function and its batching configuration. Every
executed batch is zero-padded up to one of ``batch_sizes`` (the static shapes
compiled ahead of time; PopRT's behaviour with ``[batch_size]``) and the
padding rows are cut from the results. :meth:`Serving.run` executes inline in
the caller, any size, in chunks of at most ``batch_size``; a server
(:func:`jitserve.serve`) batches concurrent callers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import compilers
from ..batch import Batch, RowSignature
from ..defn import defn_errors, resolve_options, warn_large_constants
from ..errors import BatchError, OptionError, OutputShapeError, raised_by_model
from ..packed import PackedLayout
from ..params import load_params, release_pages
from ..template import Template, check_params, is_template, params_template, template_of
from .options import (
    ISOLATION_MODES,
    OVERSIZE_MODES,
    ServingOptions,
    check_batch_sizes,
    check_labels,
    check_wire,
    count_option,
    optional_count,
    queue_policy,
    seconds_option,
)
from .queue import BatchPolicy
from .request import concatenate_outputs, finish, model_code, prepare
from .stats import Phases


class Executor:
    """One partition's executables: one per (padded batch size, row signature, batch key), compiled on first use.

    With ``reuse_inputs`` (an executor that runs one batch at a time: a server's partition, for a compiler
    that compiles, so that no user code keeps the inputs), every batch is written into the same input
    buffers, one per leaf position, grown to the largest batch seen, instead of new arrays: a large batch no
    longer pays for fresh pages each time. Outputs that share memory with them (the evaluator returning a
    view of its input) are copied before they leave."""

    def __init__(self, serving: Serving, options: Mapping[str, Any], on_compile: Callable[[], None],
                 reuse_inputs: bool = False) -> None:
        self.serving = serving
        self.compiler = compilers.get(serving.compiler_name)
        self.options = dict(options)
        self._on_compile = on_compile
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self._reuse_inputs = reuse_inputs
        self._input_buffers: list[np.ndarray] = []
        # the weights travel to the executables packed into few arrays: each array a call passes costs time
        self._layout = PackedLayout(serving.params_template)

    def compiled(self, rows: int, tree: Any, row_signature: RowSignature,
                 batch_key: Any = None) -> Callable[..., Any]:
        key = (rows, tree, row_signature, batch_key)
        run = self._compiled.get(key)
        if run is None:
            with self._lock:
                run = self._compiled.get(key)
                if run is None:
                    run = self._compiled[key] = self._compile(rows, tree, row_signature, batch_key)
        return run

    def _compile(self, rows: int, tree: Any, row_signature: RowSignature, batch_key: Any) -> Callable[..., Any]:
        serving = self.serving
        templates = jax.tree_util.tree_unflatten(tree, [Template((rows, *shape), dtype)
                                                        for shape, dtype in row_signature])
        compiler = self.compiler
        fn = serving.batch_function(batch_key)
        arguments = serving.arguments(templates)
        with defn_errors():
            if compiler.compiles:
                warn_large_constants(fn, arguments, f"serving function {getattr(serving.fn, '__name__', serving.fn)!r}",
                                     owner=serving.fn)
            if serving.has_params:
                fn, arguments = self._layout.taking_packed(fn), [self._layout.templates, *arguments[1:]]
            executable = compiler.compile(fn, arguments, self.options)
        if compiler.compiles:
            self._on_compile()
        return executable.run

    def place(self, params: Any) -> Any:
        """The serving's weights (a pytree shaped like ``params_template``) resident on this partition's
        device, packed as its executables take them, to give every :meth:`execute`: one array at a time,
        each memory-mapped array's file pages released once it is copied, so that a loaded checkpoint is
        never held twice, not even while it is placed."""
        placed = []
        for array in self._layout.pack(params):
            placed.append(self.compiler.place(array, self.options))
            release_pages(array)
        release_pages(params)  # the vectors, now in packed copies
        return placed

    def close(self) -> None:
        """Nothing to release: the executables go with the executor."""

    def execute(self, batch: Batch, params: Any) -> tuple[Any, Phases]:
        """Run one batch (``batch.size`` rows padded by ``batch.padding``) with ``params`` as :meth:`place`
        gave them: the outputs cut to the real rows, as numpy, and the time each phase took: the batch
        stacked and padded (input; the executable copies it to the device within its call), the
        executable until its outputs are computed (infer), the outputs copied to the host and cut (output).
        A serving that yields steps gives a generator of them, whose time is spent as it is read."""
        rows = batch.size + batch.padding
        run = self.compiled(rows, batch.tree, batch.row_signature, batch.user_key)
        buffers = self._input_buffers  # empty unless reused: then outputs are checked against them
        started = time.perf_counter()
        # one request's whole rows go as they are (the executable copies them in); else stacked and padded,
        # into the reused buffers
        inputs = batch.given() if self._reuse_inputs else None
        if inputs is None:
            inputs = batch.materialize(self._input_buffer if self._reuse_inputs else None)
        computing = time.perf_counter()
        outputs = model_code(run, params, inputs) if self.serving.has_params else model_code(run, inputs)
        if self.serving.streaming:  # a generator of steps, each cut as it comes
            return _steps_cut(outputs, rows, batch.size, buffers), Phases(computing - started)
        jax.block_until_ready(outputs)  # computed here, so that the copy to the host below is all it times
        cutting = time.perf_counter()
        cut = cut_rows(outputs, rows, batch.size, buffers)
        return cut, Phases(computing - started, cutting - computing, time.perf_counter() - cutting)

    def _input_buffer(self, leaf: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Leaf ``leaf``'s input buffer as an array of ``shape`` and ``dtype``, grown if it is too small."""
        buffers = self._input_buffers
        size = math.prod(shape) * dtype.itemsize
        if leaf == len(buffers):
            buffers.append(np.empty(size, np.uint8))
        elif buffers[leaf].size < size:
            buffers[leaf] = np.empty(size, np.uint8)
        return buffers[leaf][:size].view(dtype).reshape(shape)


def owned_host_array(value: Any) -> np.ndarray:
    """A numpy copy of a device array (jax, or IREE's, whose host view may be reused by later calls):
    callers keep slices of the outputs."""
    to_host = getattr(value, "to_host", None)
    return np.array(to_host() if to_host is not None else value)


def _steps_cut(steps: Iterator[Any], rows: int, keep: int, inputs: Sequence[np.ndarray]) -> Iterator[Any]:
    """A streaming serving's steps, each cut to the real rows as it comes; what its generator raises is the
    model's own failure."""
    try:
        for step in steps:
            yield cut_rows(step, rows, keep, inputs)
    except Exception as error:
        raised_by_model(error)
        raise


def cut_rows(outputs: Any, rows: int, keep: int, inputs: Sequence[np.ndarray] | None = None) -> Any:
    """The first ``keep`` of the ``rows`` rows of every output, as host numpy arrays that own their memory or
    share none with the reused ``inputs`` buffers."""
    leaves, tree = jax.tree_util.tree_flatten(outputs)
    if not leaves:
        raise OutputShapeError(f"the serving function must return batch-major outputs (axis 0 = the {rows} rows of "
                               f"the batch); it returned no array ({outputs!r:.80})")
    cut = []
    for leaf in leaves:
        if type(leaf) is not np.ndarray:
            array = owned_host_array(leaf)
        elif inputs and any(np.may_share_memory(leaf, buffer) for buffer in inputs):
            array = leaf.copy()  # a view of the input buffer, which the next batch overwrites
        else:
            array = leaf
        if array.ndim == 0 or array.shape[0] != rows:
            raise OutputShapeError(
                f"the serving function must return batch-major outputs (axis 0 = the {rows} rows of the batch); "
                f"got an output of {template_of(array)}"
            )
        cut.append(array if keep == rows else array[:keep])
    return jax.tree_util.tree_unflatten(tree, cut)


class Serving:
    """A function served with dynamic batching; see :func:`jitserve.serve` for the server."""

    generates = False  # its server batches rows (a Generation's generates)

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        params: Any = None,
        batch_size: int = 1,
        batch_timeout: float = 0.1,
        batch_sizes: Sequence[int] | None = None,
        oversize: str = "split",
        partitions: int = 1,
        max_queue: int | None = None,
        input_template: Any = None,
        preprocess: Callable[[Any], Batch] | None = None,
        postprocess: Callable[..., Any] | None = None,
        compiler: str | None = None,
        isolation: str | None = None,
        batch_keys: Sequence[Any] | None = None,
        priority_levels: int = 1,
        default_priority: int | None = None,
        priority_aging: float = 1.0,
        priority_queues: Mapping[int, Mapping[str, Any]] | None = None,
        adaptive: bool = True,
        streaming: bool = False,
        isolate_failures: bool = True,
        labels: Mapping[str, Sequence[str]] | None = None,
        wire: Mapping[str, Any] | None = None,
        **compiler_options: Any,
    ) -> None:
        self.options = ServingOptions(
            fn, params, batch_size, batch_timeout, batch_sizes, oversize, partitions, max_queue, input_template,
            preprocess, postprocess, compiler, isolation, batch_keys, priority_levels, default_priority,
            priority_aging, priority_queues, adaptive, streaming, isolate_failures, labels, wire,
            types.MappingProxyType(compiler_options))
        if not callable(fn):
            raise OptionError(f"a Serving needs a function to serve, got {type(fn).__name__} {fn!r:.80}")
        self.fn = fn
        self.params_source = None if params is None or not isinstance(params, (str, os.PathLike)) \
            else os.fspath(params)  # a weights file: where a reload reads them again
        params = params if self.params_source is None else load_params(self.params_source)
        self.params = params
        self.has_params = params is not None  # stays True in a copy without them (``with_params(None)``)
        self.params_template = None if params is None else params_template(params)
        self.batch_sizes = check_batch_sizes(batch_size, batch_sizes)
        self.batch_size = int(batch_size)
        self.batch_timeout = seconds_option("batch_timeout", batch_timeout)
        if oversize not in OVERSIZE_MODES:
            raise OptionError(f"oversize must be one of {', '.join(OVERSIZE_MODES)}, got {oversize!r}")
        self.oversize = oversize
        self.partitions = count_option("partitions", partitions)
        self.max_queue = optional_count("max_queue", max_queue)
        self.input_template = (
            None if input_template is None
            else jax.tree_util.tree_map(template_of, input_template, is_leaf=is_template)
        )
        self.preprocess = preprocess
        self.postprocess = postprocess
        if streaming and compiler not in (None, "eager"):
            raise OptionError(f"a streaming serving runs its generator as written (compiler='eager'), got "
                              f"compiler={compiler!r}; compile its steps with js.jit inside it")
        self.streaming = bool(streaming)
        chosen, self.compiler_options = resolve_options(
            {**({"compiler": "eager" if streaming else compiler} if compiler or streaming else {}),
             **compiler_options})
        self.compiler_name = chosen.name
        if isolation is not None and isolation not in ISOLATION_MODES:
            raise OptionError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, got {isolation!r}")
        self.isolation = isolation or chosen.default_isolation
        if streaming and self.isolation == "process":
            raise OptionError("a streaming serving runs in the server's process (isolation='thread')")
        if batch_keys is not None and not list(batch_keys):
            raise OptionError("batch_keys must name at least one key, or be None (keys are then automatic)")
        self.batch_keys = None if batch_keys is None else tuple(batch_keys)
        self.priority_levels = count_option("priority_levels", priority_levels)
        self.default_priority = priority_levels  # the least urgent, unless said otherwise
        self.default_priority = self.priority_level(default_priority)
        self.priority_aging = seconds_option("priority_aging", priority_aging, zero=False)
        self.priority_queues = {self.priority_level(level): queue_policy(level, policy)
                                for level, policy in (priority_queues or {}).items()}
        self.adaptive = bool(adaptive)
        self.isolate_failures = bool(isolate_failures)
        self.labels = check_labels(labels)  # by output name: what Triton's classification adds to each class
        # the tensors clients send and get where preprocess and postprocess change them: what metadata lists
        self.wire = check_wire(wire)
        self._inline: tuple[Executor, Any] | None = None
        self._inline_lock = threading.Lock()

    def replace(self, **changes: Any) -> Serving:
        """A new Serving with some arguments changed (a new ``batch_size`` drops explicit ``batch_sizes``)."""
        return Serving(**self.options.changed(changes).arguments())

    def batch_function(self, batch_key: Any = None) -> Callable[..., Any]:
        """The served function with a declared batch key bound: ``f(params, batch)`` for a serving with
        weights, ``f(batch)`` without; called with :meth:`arguments`."""
        fn, key = self.fn, batch_key
        if self.batch_keys is None:
            return fn
        return (lambda params, batch: fn(params, key, batch)) if self.has_params else functools.partial(fn, key)

    def arguments(self, batch: Any, params: Any = None) -> list[Any]:
        """The positional arguments of :meth:`batch_function` around ``batch`` (arrays or templates):
        ``params`` (default: their templates) first for a serving with weights."""
        if not self.has_params:
            return [batch]
        return [self.params_template if params is None else params, batch]

    def check_params(self, params: Any) -> Any:
        """``params`` if it has the structure, shapes and dtypes of the serving's weights, else a
        TemplateMismatchError naming the first leaf that differs (``params['w']: expected ...``)."""
        if not self.has_params:
            raise OptionError("this serving was built without params=; it has no weights to update")
        return check_params(params, self.params_template)

    def with_params(self, params: Any) -> Serving:
        """A copy that shares everything but the weights: ``None`` strips them (their templates stay: what a
        worker process or a cluster's caller needs, which get the weights another way or not at all);
        a tree puts them back, checked against the templates."""
        copy = Serving.__new__(Serving)
        copy.__setstate__({**self.__getstate__(), "params": None if params is None else self.check_params(params),
                           "options": dataclasses.replace(self.options, params=params)})
        return copy

    @functools.cached_property
    def policy(self) -> BatchPolicy:
        """How a server of this serving forms batches (see ``queue.py``)."""
        limits = tuple((level, policy["max_queue"]) for level, policy in self.priority_queues.items()
                       if policy.get("max_queue") is not None)
        return BatchPolicy(self.batch_size, tuple(self.batch_sizes), self.batch_timeout, self.max_queue,
                           priority_levels=self.priority_levels, priority_aging=self.priority_aging,
                           level_max_queue=limits, adaptive=self.adaptive, whole_requests=self.streaming)

    def priority_level(self, priority: int | None) -> int:
        """The level a request of ``priority`` queues at: 1..priority_levels (1 the most urgent), None or 0
        the default level (Triton's convention)."""
        if priority is None or priority == 0:
            return self.default_priority
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
                or not 1 <= priority <= self.priority_levels:
            raise BatchError(f"priority must be 0 (the default level) or 1..{self.priority_levels} "
                             f"(1 is the most urgent), got {priority!r}")
        return int(priority)

    def default_timeout(self, priority: int | None) -> float | None:
        """The timeout of a request at this priority when its caller gives none (``priority_queues``)."""
        if not self.priority_queues:
            return None
        return self.priority_queues.get(self.priority_level(priority), {}).get("timeout")

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

    def check_key(self, batch: Batch) -> None:
        """With declared ``batch_keys``, a batch must carry one of them."""
        if self.batch_keys is not None and batch.user_key not in self.batch_keys:
            raise BatchError(f"unknown batch key: {batch.user_key!r} "
                             f"(expected one of {', '.join(repr(k) for k in self.batch_keys)})")

    def run(self, value: Any) -> Any:
        """Run inline in the caller: any number of rows, in padded chunks of at most ``batch_size``."""
        batch, info = prepare(self.preprocess, value)
        self.check_key(batch)
        if self._inline is None:
            with self._inline_lock:
                if self._inline is None:
                    executor = Executor(self, self.partition_options()[0], lambda: None)
                    self._inline = executor, executor.place(self.params) if self.params is not None else ()
        executor, params = self._inline
        parts = []
        for chunk in batch.chunks(self.batch_size):
            parts.append(executor.execute(chunk.pad_to(self.policy.padded_size(chunk.size)), params)[0])
        return finish(self.postprocess, concatenate_outputs(parts), info)

    def fingerprint_fields(self) -> dict[str, Any]:
        """What identifies what this serving computes, for a digest another process computes alike (a cluster
        adopts only replicas whose digest matches): its functions, its checked options, and its weights'
        templates and file. The weights' values are not among them: a digest reads them from ``params``."""
        names = ("fn", "preprocess", "postprocess", "params_source", "has_params", "params_template", "batch_size",
                 "batch_sizes", "batch_timeout", "oversize", "partitions", "max_queue", "input_template", "streaming",
                 "compiler_name", "compiler_options", "isolation", "batch_keys", "priority_levels", "default_priority",
                 "priority_aging", "priority_queues", "adaptive", "isolate_failures", "labels", "wire")
        return {name: getattr(self, name) for name in names}

    def __getstate__(self) -> dict[str, Any]:
        """What travels to another process (a cluster replica or client): the configuration, not the
        executables compiled here."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_inline", "_inline_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._inline = None
        self._inline_lock = threading.Lock()

    @property
    def functions(self) -> tuple[Callable[..., Any], ...]:
        """The user's functions it compiles (``fn``); the last names a server by default."""
        return (self.fn,)

    def __repr__(self) -> str:
        return (f"Serving({getattr(self.fn, '__name__', self.fn)!r}, batch_size={self.batch_size}, "
                f"batch_sizes={self.batch_sizes}, compiler={self.compiler_name!r})")
