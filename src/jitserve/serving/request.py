"""One request's life: its handle, its stream, every way to wait for it, and the corridor every caller takes.

A :class:`Request` is one caller's rows in flight; local servers, the cluster
coalescer and the network fronts all hand out and wait on this one type.
:class:`Corridor` is the part of a server its callers see: ``call``,
``call_async`` and ``open_stream`` do prepare (the serving's ``preprocess``)
-> submit -> wait -> finish (``postprocess``), the one path of every request,
whether it comes from :func:`jitserve.batched_run`, the network or a cluster
replica; the waiting itself (sync, asyncio, streamed, with timeouts and
withdrawal) is written here once.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue as thread_queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..batch import Batch
from ..errors import (
    BatchError,
    BatchSizeError,
    QueueFullError,
    RequestTooLargeError,
    ServerStoppedError,
    raised_by_model,
)
from .options import seconds_option

if TYPE_CHECKING:
    from .partition import ServerStats
    from .queue import Queues
    from .serving import Serving

END = object()  # the last item of a stream
# the caller's trace context (a network front's, when it traces): opaque here, carried from submission to the
# reports of the batches that run the request's rows (``BatchReport.traces``)
TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar("jitserve_trace", default=None)
NO_INFO = object()  # what ``prepare`` gives as info when ``preprocess`` returned a bare batch
_ABANDONED = ConnectionAbortedError("the caller stopped reading the stream")


def model_code(function: Callable[..., Any], *arguments: Any) -> Any:
    """``function(*arguments)``, the user's code (a serving's function, ``preprocess``, ``postprocess``):
    what it raises is the model's own failure."""
    try:
        return function(*arguments)
    except Exception as error:
        raised_by_model(error)
        raise


def prepare(serving: Serving, value: Any) -> tuple[Batch, Any]:
    """The caller's input as ``(batch, info)``: through ``preprocess`` when given, which may return a
    Batch or ``(batch, info)`` (Nx's ``client_preprocessing``); info is ``NO_INFO`` without one."""
    prepared = value if serving.preprocess is None else model_code(serving.preprocess, value)
    batch, info = prepared if type(prepared) is tuple and len(prepared) == 2 else (prepared, NO_INFO)
    if not isinstance(batch, Batch):
        raise BatchError(
            f"expected a jitserve.Batch (build one with Batch.stack or Batch.concatenate), "
            f"or (batch, info) from preprocess; got {type(prepared).__name__}"
        )
    if batch.size == 0:
        raise BatchError("the batch holds no rows; send at least one")
    return batch, info


def finish(serving: Serving, outputs: Any, info: Any = NO_INFO, metadata: Sequence[Any] = ()) -> Any:
    """``postprocess(outputs)``; when ``preprocess`` gave info, ``postprocess((outputs, metadata), info)``
    as Nx's ``client_postprocessing`` (``metadata``: the reports of the batches that ran the rows)."""
    if serving.postprocess is None:
        return outputs
    if info is NO_INFO:
        return model_code(serving.postprocess, outputs)
    return model_code(serving.postprocess, (outputs, tuple(metadata)), info)


def concatenate_outputs(parts: Sequence[Any]) -> Any:
    """Outputs of consecutive row ranges joined on axis 0 (the parts of a split request)."""
    if len(parts) == 1:
        return parts[0]
    flat = [jax.tree_util.tree_flatten(p) for p in parts]
    tree = flat[0][1]
    return jax.tree_util.tree_unflatten(tree, [np.concatenate(leaves) for leaves in zip(*(f[0] for f in flat))])


class Stream:
    """Where a streaming request's items go as batches finish: ``(row offset or step, outputs)``, an
    exception, then ``END``; a thread-safe queue for a sync caller, an asyncio one on the caller's loop."""

    __slots__ = ("loop", "items")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.items: Any = thread_queue.SimpleQueue() if loop is None else asyncio.Queue()

    def put(self, item: Any) -> None:
        put_all([(self, item)])


def put_all(deliveries: Sequence[tuple[Stream, Any]]) -> None:
    """Each ``(stream, item)``, in order: put on a thread's stream at once, and handed to each asyncio caller's
    event loop in one call for all of its streams (one wake-up of a network front's loop per step, not one
    per stream)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for stream, item in deliveries:
        if stream.loop is None:
            stream.items.put(item)
        else:
            by_loop.setdefault(stream.loop, []).append((stream.items, item))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_nowait_each, puts)
        except RuntimeError:  # the callers' loop is closed: nobody is reading any more
            pass


def _put_nowait_each(puts: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for items, item in puts:
        items.put_nowait(item)


class Request:
    """One caller's rows in flight. A sync caller waits on ``done`` (a held lock released when the request
    finishes); an asyncio caller awaits ``future``, resolved on its own ``loop``; a streaming caller reads
    its ``stream``. ``parts`` collects ``(row offset, outputs)`` as batches finish (``(step, outputs)`` for
    a serving that yields steps), ``reports`` the report of each batch that ran some of its rows;
    ``error`` is set instead when the request failed. ``level`` is its priority level; ``weights`` the
    version of a serving's weights its first rows ran with, which all its rows run with (None before)."""

    __slots__ = ("rows", "rows_left", "parts", "reports", "error", "started", "done", "loop", "future", "level",
                 "stream", "weights", "trace")

    def __init__(self, rows: int, loop: asyncio.AbstractEventLoop | None, level: int = 1,
                 stream: bool = False) -> None:
        self.rows = rows
        self.rows_left = rows
        self.parts: list[tuple[int, Any]] = []
        self.reports: list[Any] = []
        self.error: BaseException | None = None
        self.started = False
        self.loop = loop
        self.level = level
        self.stream = Stream(loop) if stream else None
        self.future: asyncio.Future[None] | None = None
        self.weights: Any = None
        self.trace: Any = TRACE.get()
        if loop is None:
            self.done = threading.Lock()
            self.done.acquire()
        else:
            self.future = loop.create_future()

    def fail(self, error: BaseException) -> bool:
        """Finish the request with ``error`` unless it already failed; True if this call finished it."""
        if self.error is not None:
            return False
        self.error = error
        self.rows_left = 0
        if self.stream is not None:
            self.stream.put(error)
        return True


class Corridor:
    """The callers' side of a server (mixed into :class:`~jitserve.serving.server.Server`, whose state it
    shares under the server's lock): the corridor every request takes, submission, the ways to wait, and
    taking a request back."""

    name: str
    serving: Serving
    _lock: threading.RLock
    _cond: threading.Condition
    _queues: Queues
    _stopping: bool
    _stats: ServerStats

    def submit(self, batch: Batch, loop: asyncio.AbstractEventLoop | None = None,
               priority: int | None = None, stream: bool = False) -> Request:
        """Queue the batch's rows (split into pieces of at most ``batch_size``) at ``priority`` (1 is the
        most urgent level; None or 0: the serving's default); returns the request.

        Give the running ``loop`` for a caller that will await :meth:`result_async` or read
        :meth:`stream_async`; ``stream=True`` for a caller that reads the results as they come."""
        serving = self.serving
        size = batch.size
        if serving.batch_keys is not None:
            serving.check_key(batch)
        level = serving.default_priority if priority is None else serving.priority_level(priority)
        if size > serving.batch_size and (serving.oversize == "error" or serving.streaming):
            why = " (a streaming serving runs each request in one batch)" if serving.streaming else ""
            raise BatchSizeError(f"batch size ({size}) cannot exceed server batch size of {serving.batch_size}{why}")
        parts = batch.chunks(serving.batch_size) if size > serving.batch_size else [batch]
        request = Request(size, loop, level, stream)
        queues = self._queues
        with self._lock:
            if self._stopping:
                raise ServerStoppedError(f"server {self.name!r} is stopped and takes no new requests")
            try:
                queues.admit(size, level, self.name)
            except (QueueFullError, RequestTooLargeError):
                self._stats.rejected += 1
                raise
            self._stats.requests += 1
            if queues.add(request, parts, batch.signature, time.monotonic()):
                self._cond.notify()  # else a waiting partition wakes at the deadline it already knows
        return request

    def _abandon(self, request: Request) -> None:
        """A streaming caller stopped reading: its queued rows leave the queues, and a running streaming
        batch stops at its next step once none of its callers reads. Counted as cancelled."""
        with self._lock:
            if request.rows_left == 0:
                return
            self._queues.withdraw(request)
            request.fail(_ABANDONED)
            self._stats.cancelled += 1

    def _withdraw(self, request: Request, timed_out: bool) -> bool:
        """Take a request that has not started (nor finished) off the queues; False if it had."""
        with self._lock:
            if request.started or request.rows_left == 0:
                return False
            self._queues.withdraw(request)
            request.rows_left = 0
            if timed_out:
                self._stats.timeouts += 1
            else:
                self._stats.cancelled += 1
            return True

    # the corridor: prepare -> submit -> wait -> finish -----------------------------------------

    def call(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Any:
        """Run ``value`` (what the serving's ``preprocess`` takes, else a Batch) batched with concurrent
        callers, at ``priority`` (1 the most urgent level; None: the default); ``preprocess`` and
        ``postprocess`` run in the caller. Returns exactly this caller's results. ``timeout``: give up on
        a request whose rows have not started after that many seconds (default: its level's)."""
        request, info, timeout = self._enter(value, timeout, priority, None, False)
        return finish(self.serving, self.result(request, timeout), info, request.reports)

    async def call_async(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Any:
        """:meth:`call` for asyncio callers: awaits the rows without blocking the event loop."""
        request, info, timeout = self._enter(value, timeout, priority, asyncio.get_running_loop(), False)
        return finish(self.serving, await self.result_async(request, timeout), info, request.reports)

    def open_stream(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Iterator[Any]:
        """:meth:`call` whose results come as they are ready: this caller's rows in order, one part per
        batch that ran some of them, or one item per step of a serving that yields steps; ``postprocess``
        runs on each. The request is prepared and queued now (its errors raise here); closing the iterator
        early takes the rows that have not started off the queue."""
        request, info, timeout = self._enter(value, timeout, priority, None, True)
        return (finish(self.serving, outputs, info, request.reports) for outputs in self.stream(request, timeout))

    def open_stream_async(self, value: Any, timeout: float | None = None,
                          priority: int | None = None) -> AsyncIterator[Any]:
        """:meth:`open_stream` for a caller on a running event loop: an async iterator."""
        request, info, timeout = self._enter(value, timeout, priority, asyncio.get_running_loop(), True)
        return self._finished_async(self.stream_async(request, timeout), request, info)

    async def _finished_async(self, items: AsyncIterator[Any], request: Request, info: Any) -> AsyncIterator[Any]:
        async for outputs in items:
            yield finish(self.serving, outputs, info, request.reports)

    def _enter(self, value: Any, timeout: float | None, priority: int | None,
               loop: asyncio.AbstractEventLoop | None, stream: bool) -> tuple[Request, Any, float | None]:
        """Prepare and queue: the request, ``preprocess``'s info and the timeout to wait with."""
        if timeout is not None:
            seconds_option("timeout", timeout, or_none=True)
        serving = self.serving
        batch, info = prepare(serving, value)
        request = self.submit(batch, loop, priority, stream)
        if timeout is None and serving.priority_queues:
            timeout = serving.default_timeout(priority)
        return request, info, timeout

    # waiting --------------------------------------------------------------------------------------

    def result(self, request: Request, timeout: float | None) -> Any:
        """Wait for the request's outputs (before ``postprocess``); on ``timeout`` before its rows
        started, withdraw it and raise TimeoutError."""
        if not request.done.acquire(timeout=-1 if timeout is None else timeout):
            if self._withdraw(request, timed_out=True):
                raise self._timeout_error(timeout)
            request.done.acquire()
        return self._outcome(request)

    async def result_async(self, request: Request, timeout: float | None) -> Any:
        """``result`` for a request submitted with its event loop. A caller cancelled before its rows
        started (a client that went away) takes them off the queue."""
        future = request.future
        if future is None:
            raise TypeError("result_async needs a request submitted with its event loop")
        try:
            if timeout is None:
                await future
            else:
                try:
                    await asyncio.wait_for(asyncio.shield(future), timeout)
                except TimeoutError:
                    if self._withdraw(request, timed_out=True):
                        raise self._timeout_error(timeout) from None
                    await future
        except asyncio.CancelledError:  # the caller went away: none of its queued rows run for nobody
            self._abandon(request)
            raise
        return self._outcome(request)

    def _timeout_error(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"request to server {self.name!r} timed out after {timeout}s before its rows started")

    def _outcome(self, request: Request) -> Any:
        if request.error is not None:
            raise request.error
        parts = request.parts
        if len(parts) > 1:
            parts.sort(key=lambda part: part[0])
        if self.serving.streaming:  # one output per step the serving yielded
            return [outputs for _, outputs in parts]
        return concatenate_outputs([outputs for _, outputs in parts])

    def stream(self, request: Request, timeout: float | None) -> Iterator[Any]:
        """The outputs of a ``stream=True`` request as they come: consecutive row ranges in order (each
        step, for a serving that yields steps). Closing the iterator early takes unstarted rows off the
        queues; ``timeout`` as for :meth:`result`."""
        items = request.stream.items  # type: ignore[union-attr]
        order = StreamOrder(self.serving.streaming)
        try:
            while True:
                try:
                    ready = order.take(items.get(timeout=None if request.started else timeout))
                except thread_queue.Empty:
                    self._expire(request, timeout)
                    continue
                if ready is None:
                    return
                yield from ready
        finally:
            self._abandon(request)

    async def stream_async(self, request: Request, timeout: float | None) -> AsyncIterator[Any]:
        """:meth:`stream` for a request submitted with its event loop and ``stream=True``."""
        items = request.stream.items  # type: ignore[union-attr]
        order = StreamOrder(self.serving.streaming)
        try:
            while True:
                try:
                    ready = order.take(await asyncio.wait_for(items.get(), None if request.started else timeout))
                except TimeoutError:
                    self._expire(request, timeout)
                    continue
                if ready is None:
                    return
                for outputs in ready:
                    yield outputs
        finally:
            self._abandon(request)

    def _expire(self, request: Request, timeout: float | None) -> None:
        """A streaming request's timeout passed: withdrawn with TimeoutError unless its rows started."""
        if self._withdraw(request, timed_out=True):
            raise self._timeout_error(timeout) from None


def resolve_futures(requests: list[Request]) -> None:
    """On an event loop: wake the asyncio callers whose requests finished (one hop per loop and batch)."""
    for request in requests:
        if request.future is not None and not request.future.done():
            request.future.set_result(None)


class StreamOrder:
    """Puts a stream's items in order: row ranges by offset (they may finish out of order on several
    partitions), steps as they come."""

    __slots__ = ("steps", "waiting", "next_offset")

    def __init__(self, steps: bool) -> None:
        self.steps = steps
        self.waiting: dict[int, Any] = {}
        self.next_offset = 0

    def take(self, item: Any) -> list[Any] | None:
        """The outputs now ready to hand out after ``item``; None at the end; a failure raises."""
        if item is END:
            return None
        if isinstance(item, BaseException):
            raise item
        key, outputs = item
        if self.steps:
            return [outputs]
        self.waiting[key] = outputs
        ready = []
        while self.next_offset in self.waiting:
            outputs = self.waiting.pop(self.next_offset)
            self.next_offset += len(jax.tree_util.tree_leaves(outputs)[0])
            ready.append(outputs)
        return ready
