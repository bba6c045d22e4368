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
import queue as thread_queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import jax

from ..batch import Batch
from .serving import concatenate_outputs, optional_seconds

if TYPE_CHECKING:
    from .serving import Serving

END = object()  # the last item of a stream


class Stream:
    """Where a streaming request's items go as batches finish: ``(row offset or step, outputs)``, an
    exception, then ``END``; a thread-safe queue for a sync caller, an asyncio one on the caller's loop."""

    __slots__ = ("loop", "items")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.items: Any = thread_queue.SimpleQueue() if loop is None else asyncio.Queue()

    def put(self, item: Any) -> None:
        if self.loop is None:
            self.items.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is reading any more
            pass


class Request:
    """One caller's rows in flight. A sync caller waits on ``done`` (a held lock released when the request
    finishes); an asyncio caller awaits ``future``, resolved on its own ``loop``; a streaming caller reads
    its ``stream``. ``parts`` collects ``(row offset, outputs)`` as batches finish (``(step, outputs)`` for
    a serving that yields steps), ``reports`` the report of each batch that ran some of its rows;
    ``error`` is set instead when the request failed. ``level`` is its priority level; ``weights`` the
    version of a serving's weights its first rows ran with, which all its rows run with (None before)."""

    __slots__ = ("rows", "rows_left", "parts", "reports", "error", "started", "done", "loop", "future", "level",
                 "stream", "weights")

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
    """The callers' side of a server: the corridor every request takes, and the ways to wait. The server
    supplies ``submit`` (queue a batch), ``_withdraw`` (take an unstarted request back) and ``_abandon``
    (a caller stopped reading)."""

    name: str
    serving: Serving

    def submit(self, batch: Batch, loop: asyncio.AbstractEventLoop | None = None, priority: int | None = None,
               stream: bool = False) -> Request:
        raise NotImplementedError

    def _withdraw(self, request: Request, timed_out: bool) -> bool:
        raise NotImplementedError

    def _abandon(self, request: Request) -> None:
        raise NotImplementedError

    # the corridor: prepare -> submit -> wait -> finish -----------------------------------------

    def call(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Any:
        """Run ``value`` (what the serving's ``preprocess`` takes, else a Batch) batched with concurrent
        callers, at ``priority`` (1 the most urgent level; None: the default); ``preprocess`` and
        ``postprocess`` run in the caller. Returns exactly this caller's results. ``timeout``: give up on
        a request whose rows have not started after that many seconds (default: its level's)."""
        request, info, timeout = self._enter(value, timeout, priority, None, False)
        return self.serving.finish(self.result(request, timeout), info, request.reports)

    async def call_async(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Any:
        """:meth:`call` for asyncio callers: awaits the rows without blocking the event loop."""
        request, info, timeout = self._enter(value, timeout, priority, asyncio.get_running_loop(), False)
        return self.serving.finish(await self.result_async(request, timeout), info, request.reports)

    def open_stream(self, value: Any, timeout: float | None = None, priority: int | None = None) -> Iterator[Any]:
        """:meth:`call` whose results come as they are ready: this caller's rows in order, one part per
        batch that ran some of them, or one item per step of a serving that yields steps; ``postprocess``
        runs on each. The request is prepared and queued now (its errors raise here); closing the iterator
        early takes the rows that have not started off the queue."""
        request, info, timeout = self._enter(value, timeout, priority, None, True)
        return (self.serving.finish(outputs, info, request.reports) for outputs in self.stream(request, timeout))

    def open_stream_async(self, value: Any, timeout: float | None = None,
                          priority: int | None = None) -> AsyncIterator[Any]:
        """:meth:`open_stream` for a caller on a running event loop: an async iterator."""
        request, info, timeout = self._enter(value, timeout, priority, asyncio.get_running_loop(), True)
        return self._finished_async(self.stream_async(request, timeout), request, info)

    async def _finished_async(self, items: AsyncIterator[Any], request: Request, info: Any) -> AsyncIterator[Any]:
        async for outputs in items:
            yield self.serving.finish(outputs, info, request.reports)

    def _enter(self, value: Any, timeout: float | None, priority: int | None,
               loop: asyncio.AbstractEventLoop | None, stream: bool) -> tuple[Request, Any, float | None]:
        """Prepare and queue: the request, ``preprocess``'s info and the timeout to wait with."""
        optional_seconds("timeout", timeout)
        serving = self.serving
        batch, info = serving.prepare(value)
        request = self.submit(batch, loop, priority, stream)
        return request, info, serving.default_timeout(priority) if timeout is None else timeout

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
