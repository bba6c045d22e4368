"""The corridor: the part of a server its callers see, the one path of every request.

What a caller asks a serving is :class:`Rows` (its value, timeout and
priority). :class:`Corridor` (each server owns one) and its ``call``,
``call_async``, ``stream`` and ``stream_async`` of Rows, the server's entry
points of :class:`~jitserve.serving.front.Front`, do prepare (the serving's
``preprocess``) -> submit -> wait -> finish (``postprocess``), the one path of
every request, whether it comes from :func:`jitserve.batched_run`, the network
or a cluster replica; the waiting itself (sync, asyncio, streamed, with
timeouts and withdrawal) is written here once. The request handle it hands
out and waits on is :class:`~jitserve.serving.request.Request`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from ..batch import Batch
from ..errors import BatchSizeError, QueueFullError, RequestTooLargeError, ServerStoppedError
from .front import wrong_request
from .options import seconds_option
from .queue import Queues
from .request import Reading, Request, concatenate_outputs, finish, off_loop, prepare, read, read_async, text_size
from .serving import Serving
from .stats import ServerStats

_ABANDONED = ConnectionAbortedError("the caller stopped reading the stream")


@dataclass(frozen=True, slots=True)
class Rows:
    """What a caller asks a serving's server: run ``value`` (a Batch, or what the serving's ``preprocess``
    takes) batched with concurrent callers at ``priority`` (1 the most urgent level; None: the serving's
    default); ``timeout``: give up on rows that have not started after that many seconds (None: the
    level's default)."""

    servable: ClassVar[str] = "js.Serving"  # what serves it, and the function that asks it, in errors
    entry: ClassVar[str] = "js.batched_run"
    value: Any
    timeout: float | None = None
    priority: int | None = None


class Corridor:
    """The callers' side of a server, an object the server owns (``server.corridor``) over the state it
    shares with it: the name and serving, the server's lock and the condition its partitions wait on, the
    queues, the counters, and whether the server is stopping. The corridor every request takes,
    submission, the ways to wait, and taking a request back."""

    def __init__(self, name: str, serving: Serving, lock: threading.RLock, cond: threading.Condition,
                 queues: Queues, stats: ServerStats, stopping: Callable[[], bool]) -> None:
        self.name = name
        self.serving = serving
        self._lock = lock
        self._cond = cond
        self._queues = queues
        self._stats = stats
        self._stopping = stopping

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
            if self._stopping():
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

    def call(self, rows: Rows) -> Any:
        """Run the rows batched with concurrent callers; ``preprocess`` and ``postprocess`` run in the
        caller. Returns exactly this caller's results."""
        request, info, timeout = self._enter(rows, None, False)
        return finish(self.serving.postprocess, self.result(request, timeout), info, request.reports)

    async def call_async(self, rows: Rows) -> Any:
        """:meth:`call` for asyncio callers: awaits the rows without blocking the event loop (``preprocess``
        runs on a thread where the rows are many texts or long ones, see :meth:`open_stream`)."""
        request, info, timeout = await self._enter_async(rows, False)
        return finish(self.serving.postprocess, await self.result_async(request, timeout), info, request.reports)

    def stream(self, rows: Rows) -> Generator[Any, None, None]:
        """:meth:`call` whose results come as they are ready: this caller's rows in order, one part per
        batch that ran some of them, or one item per step of a serving that yields steps; ``postprocess``
        runs on each. The request is prepared and queued now (its errors raise here); closing the iterator
        early takes the rows that have not started off the queue."""
        request, info, timeout = self._enter(rows, None, True)
        postprocess = self.serving.postprocess
        return (finish(postprocess, outputs, info, request.reports) for outputs in self.outputs(request, timeout))

    def stream_async(self, rows: Rows) -> AsyncGenerator[Any, None]:
        """:meth:`stream` for a caller on a running event loop: an async iterator."""
        request, info, timeout = self._enter(rows, asyncio.get_running_loop(), True)
        return self._finished_async(self.outputs_async(request, timeout), request, info)

    async def open_stream(self, rows: Rows) -> AsyncGenerator[Any, None]:
        """:meth:`stream_async` whose ``preprocess`` (a tokenizer, say) runs on a thread where the rows are
        texts of ``OFF_LOOP_CHARS`` or more in all, so that the event loop goes on answering others."""
        request, info, timeout = await self._enter_async(rows, True)
        return self._finished_async(self.outputs_async(request, timeout), request, info)

    async def _finished_async(self, items: AsyncIterator[Any], request: Request,
                              info: Any) -> AsyncGenerator[Any, None]:
        async for outputs in items:
            yield finish(self.serving.postprocess, outputs, info, request.reports)

    def _enter(self, rows: Rows, loop: asyncio.AbstractEventLoop | None,
               stream: bool) -> tuple[Request, Any, float | None]:
        """Prepare and queue: the request, ``preprocess``'s info and the timeout to wait with."""
        self._check(rows)
        return self._queued(rows, *prepare(self.serving.preprocess, rows.value), loop, stream)

    async def _enter_async(self, rows: Rows, stream: bool) -> tuple[Request, Any, float | None]:
        """:meth:`_enter` on an event loop, ``preprocess`` on a thread where the rows' texts are long."""
        self._check(rows)
        size = 0 if self.serving.preprocess is None else text_size(rows.value)
        prepared = await off_loop(size, lambda: prepare(self.serving.preprocess, rows.value))
        return self._queued(rows, *prepared, asyncio.get_running_loop(), stream)

    def _check(self, rows: Rows) -> None:
        if type(rows) is not Rows:
            raise wrong_request(self.name, Rows, rows)
        if rows.timeout is not None:
            seconds_option("timeout", rows.timeout, or_none=True)

    def _queued(self, rows: Rows, batch: Any, info: Any, loop: asyncio.AbstractEventLoop | None,
                stream: bool) -> tuple[Request, Any, float | None]:
        timeout, priority = rows.timeout, rows.priority
        request = self.submit(batch, loop, priority, stream)
        if timeout is None and self.serving.priority_queues:
            timeout = self.serving.default_timeout(priority)
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

    def _reading(self, request: Request, timeout: float | None) -> Reading:
        assert request.stream is not None, "a stream=True request"
        return Reading(request.stream, timeout, lambda: request.started, lambda: self._expire(request, timeout),
                       lambda: self._abandon(request), StreamOrder(self.serving.streaming).take)

    def outputs(self, request: Request, timeout: float | None) -> Iterator[Any]:
        """The outputs of a ``stream=True`` request as they come: consecutive row ranges in order (each
        step, for a serving that yields steps). Closing the iterator early takes unstarted rows off the
        queues; ``timeout`` as for :meth:`result`."""
        return read(self._reading(request, timeout))

    def outputs_async(self, request: Request, timeout: float | None) -> AsyncIterator[Any]:
        """:meth:`outputs` for a request submitted with its event loop and ``stream=True``."""
        return read_async(self._reading(request, timeout))

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

    def take(self, item: Any) -> list[Any]:
        """The outputs now ready to hand out after ``item`` (neither the end nor a failure)."""
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
