"""The in-process server: queues per batch signature, and a pool of partitions that batch from them.

Callers put pieces of at most ``batch_size`` rows on the queue of their batch
signature (key, structure, per-row shapes and dtypes). Each partition is a
worker thread with its own executables; a free partition waits for a queue
that is full or whose oldest row has waited ``batch_timeout``, takes up to
``batch_size`` rows from it (splitting a piece that does not fit), pads, runs
and hands every caller its rows. The waiting workers are the queue of free
partitions, so a row passes between threads only twice: caller to worker and
back. This is Nx.Serving's loop, with padding to compiled sizes, splitting, a
bounded queue and timeouts on top.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ..batch import Batch
from ..errors import BatchSizeError, QueueFullError, ServerStoppedError
from .serving import Executor, Serving, concatenate_outputs

log = logging.getLogger("jitserve.server")


@dataclass(frozen=True)
class BatchReport:
    """What one executed batch did: given to every batch listener after it ran."""

    server: str
    partition: int
    size: int
    padded_size: int
    queue_wait_s: float
    execution_s: float
    error: BaseException | None


class _Request:
    """One caller's rows in flight. A sync caller waits on ``done`` (a held lock the worker releases);
    an asyncio caller awaits ``future``, resolved on its own loop."""

    __slots__ = ("rows_left", "parts", "error", "started", "done", "loop", "future")

    def __init__(self, rows: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.rows_left = rows
        self.parts: list[tuple[int, Any]] = []
        self.error: BaseException | None = None
        self.started = False
        self.loop = loop
        self.done = threading.Lock()
        self.future: asyncio.Future[None] | None = None
        if loop is None:
            self.done.acquire()
        else:
            self.future = loop.create_future()


def _resolve_futures(requests: list[_Request]) -> None:
    """On an event loop: wake the asyncio callers whose requests finished (one hop per loop and batch)."""
    for request in requests:
        if request.future is not None and not request.future.done():
            request.future.set_result(None)


class _Piece:
    __slots__ = ("request", "offset", "batch", "enqueued")

    def __init__(self, request: _Request, offset: int, batch: Batch, enqueued: float) -> None:
        self.request = request
        self.offset = offset
        self.batch = batch
        self.enqueued = enqueued


class _Partition:
    """A worker thread with its own executables."""

    def __init__(self, server: "Server", index: int, executor: Executor) -> None:
        self.index = index
        self.executor = executor
        self.thread = threading.Thread(target=server._work, args=(self,), name=f"jitserve-{server.name}-p{index}",
                                       daemon=True)


class Server:
    """A named, running server of one :class:`Serving`. Use :func:`jitserve.serve` to start one."""

    def __init__(self, serving: Serving, name: str) -> None:
        self.serving = serving
        self.name = name
        self._cond = threading.Condition()
        self._queues: dict[tuple[Any, ...], deque[_Piece]] = {}
        self._queued_rows: dict[tuple[Any, ...], int] = {}
        self._queue_depth = 0
        self._stopping = False
        self._in_flight = 0
        self._listeners: list[Callable[[BatchReport], None]] = []
        self._stats: dict[str, Any] = {
            "requests": 0, "batches": 0, "rows": 0, "padded_rows": 0, "compiles": 0, "errors": 0,
            "rejected": 0, "timeouts": 0, "cancelled": 0, "batch_sizes": {}, "queue_wait_s": 0.0, "execution_s": 0.0,
        }
        self._partitions = [
            _Partition(self, i, Executor(serving, options, self._count_compile))
            for i, options in enumerate(serving.partition_options())
        ]

    # lifecycle -------------------------------------------------------------------------------

    def start(self) -> "Server":
        self.warm_up()
        for partition in self._partitions:
            partition.thread.start()
        return self

    def warm_up(self) -> None:
        """Compile every batch size on every partition for ``input_template`` (no-op without one)."""
        signature = self.serving.template_signature()
        if signature is None:
            return
        tree, row_signature = signature
        work = [(p, size) for p in self._partitions for size in self.serving.batch_sizes]
        progress = _Progress(f"{self.name}: compiling {len(self.serving.batch_sizes)} batch sizes", len(work))
        for done, (partition, size) in enumerate(work, start=1):
            started = time.perf_counter()
            partition.executor.compiled(size, tree, row_signature)
            log.info("server %s: partition %d compiled batch size %d in %.3fs",
                     self.name, partition.index, size, time.perf_counter() - started)
            progress.update(done)
        progress.close()

    def stop(self) -> None:
        """Stop taking requests, run everything already queued or in flight, then end the threads."""
        from .registry import unregister

        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        for partition in self._partitions:
            partition.thread.join()
        unregister(self.name, self)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` was called: no new requests are taken."""
        return self._stopping

    def add_batch_listener(self, listener: Callable[[BatchReport], None]) -> None:
        """Call ``listener(report)`` in the worker thread after every executed batch."""
        self._listeners.append(listener)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            stats = dict(self._stats)
            stats["batch_sizes"] = dict(stats["batch_sizes"])
            stats["queue_depth"] = self._queue_depth
            stats["in_flight"] = self._in_flight
        return stats

    def _count_compile(self) -> None:
        with self._cond:
            self._stats["compiles"] += 1

    # callers ---------------------------------------------------------------------------------

    def submit(self, batch: Batch, loop: asyncio.AbstractEventLoop | None = None) -> _Request:
        """Queue the batch's rows (split into pieces of at most ``batch_size``); returns the request.

        Give the running ``loop`` for a caller that will await :meth:`result_async`."""
        serving = self.serving
        size = batch.size
        if size > serving.batch_size and serving.oversize == "error":
            raise BatchSizeError(f"batch size ({size}) cannot exceed server batch size of {serving.batch_size}")
        parts = batch.chunks(serving.batch_size) if size > serving.batch_size else [batch]
        request = _Request(size, loop)
        signature = batch.signature
        with self._cond:
            if self._stopping:
                raise ServerStoppedError(f"server {self.name!r} is stopped and takes no new requests")
            queued = self._queued_rows.get(signature, 0)
            if serving.max_queue is not None and self._queue_depth + size > serving.max_queue:
                self._stats["rejected"] += 1
                raise QueueFullError(
                    f"server {self.name!r} queue is full: {self._queue_depth} rows queued, "
                    f"max_queue is {serving.max_queue}; a request of {size} rows was rejected"
                )
            queue = self._queues.get(signature)
            if queue is None:
                queue = self._queues[signature] = deque()
            now = time.monotonic()
            offset = 0
            for part in parts:
                queue.append(_Piece(request, offset, part, now))
                offset += part.size
            self._queued_rows[signature] = queued + size
            self._queue_depth += size
            self._stats["requests"] += 1
            if queued == 0 or queued + size >= serving.batch_size:
                # a new deadline, or a full batch: a waiting partition must look (else it wakes at the deadline)
                self._cond.notify()
        return request

    def result(self, request: _Request, timeout: float | None) -> Any:
        """Wait for the request; on ``timeout`` before its rows started, withdraw it and raise TimeoutError."""
        if not request.done.acquire(timeout=-1 if timeout is None else timeout):
            if self._withdraw(request, timed_out=True):
                raise self._timeout_error(timeout)
            request.done.acquire()
        return self._outcome(request)

    async def result_async(self, request: _Request, timeout: float | None) -> Any:
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
        except asyncio.CancelledError:
            self._withdraw(request, timed_out=False)
            raise
        return self._outcome(request)

    def _timeout_error(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"request to server {self.name!r} timed out after {timeout}s before its rows started")

    def _outcome(self, request: _Request) -> Any:
        if request.error is not None:
            raise request.error
        parts = request.parts
        if len(parts) > 1:
            parts.sort(key=lambda part: part[0])
        return self.serving.finish(concatenate_outputs([outputs for _, outputs in parts]))

    def _withdraw(self, request: _Request, timed_out: bool) -> bool:
        """Take a request that has not started off the queues; False if its rows already started."""
        with self._cond:
            if request.started:
                return False
            for signature, queue in list(self._queues.items()):
                for piece in [piece for piece in queue if piece.request is request]:
                    queue.remove(piece)
                    self._queued_rows[signature] -= piece.batch.size
                    self._queue_depth -= piece.batch.size
                if not queue:
                    del self._queues[signature], self._queued_rows[signature]
            self._stats["timeouts" if timed_out else "cancelled"] += 1
            return True

    # partitions ------------------------------------------------------------------------------

    def _ready_queue(self, now: float) -> tuple[tuple[Any, ...] | None, float | None]:
        """The queue to run now (full, timed out, or draining; oldest first), else how long to wait."""
        timeout = self.serving.batch_timeout
        best = None
        oldest = None
        wait = None
        for signature, queue in self._queues.items():
            if not queue:
                continue
            head = queue[0].enqueued
            due = head + timeout
            if self._queued_rows[signature] >= self.serving.batch_size or due <= now or self._stopping:
                if oldest is None or head < oldest:
                    best, oldest = signature, head
            elif wait is None or due - now < wait:
                wait = due - now
        return best, wait

    def _take(self, signature: tuple[Any, ...]) -> tuple[list[_Piece], Batch]:
        """Rows from the front of one queue, splitting the last piece if needed: ``batch_size`` of them
        when there are that many, else as many as :meth:`Serving.rows_to_take` says."""
        queue = self._queues[signature]
        space = self.serving.rows_to_take(self._queued_rows[signature])
        taken: list[_Piece] = []
        while queue and space:
            piece = queue[0]
            if piece.batch.size > space:
                head, tail = piece.batch.split(space)
                queue[0] = _Piece(piece.request, piece.offset + space, tail, piece.enqueued)
                piece = _Piece(piece.request, piece.offset, head, piece.enqueued)
            else:
                queue.popleft()
            piece.request.started = True
            taken.append(piece)
            space -= piece.batch.size
        rows = sum([piece.batch.size for piece in taken])
        self._queued_rows[signature] -= rows
        self._queue_depth -= rows
        if not queue:
            del self._queues[signature]
            del self._queued_rows[signature]
        merged = Batch.join([piece.batch for piece in taken])
        return taken, merged.pad_to(self.serving.padded_size(rows))

    def _next_batch(self) -> tuple[list[_Piece], Batch, float] | None:
        """Wait for a queue to be ready and take a batch from it; None once stopped and drained."""
        with self._cond:
            while True:
                signature, wait = self._ready_queue(time.monotonic())
                if signature is not None:
                    break
                if self._stopping and not self._queues:
                    return None
                self._cond.wait(wait)
            pieces, batch = self._take(signature)
            self._in_flight += 1
            if self._queues:
                self._cond.notify()  # more rows are waiting: another free partition may take them
        return pieces, batch, time.monotonic()

    # workers ---------------------------------------------------------------------------------

    def _work(self, partition: _Partition) -> None:
        while (work := self._next_batch()) is not None:
            self._execute(partition, *work)

    def _execute(self, partition: _Partition, pieces: list[_Piece], batch: Batch, formed: float) -> None:
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            outputs = partition.executor.execute(batch)
        except BaseException as failure:  # noqa: BLE001 - delivered to exactly the callers of this batch
            error = failure
        elapsed = time.perf_counter() - started
        padded = batch.size + batch.pad
        wait = sum(formed - piece.enqueued for piece in pieces)
        with self._cond:  # a split request's parts may finish on several partitions at once
            finished = self._deliver(pieces, outputs) if error is None else self._fail(pieces, error)
            stats = self._stats
            stats["batches"] += 1
            stats["rows"] += batch.size
            stats["padded_rows"] += batch.pad
            stats["batch_sizes"][padded] = stats["batch_sizes"].get(padded, 0) + 1
            stats["queue_wait_s"] += wait
            stats["execution_s"] += elapsed
            stats["errors"] += error is not None
            self._in_flight -= 1
        self._wake(finished)
        if self._listeners:
            report = BatchReport(self.name, partition.index, batch.size, padded,
                                 max(formed - piece.enqueued for piece in pieces), elapsed, error)
            for listener in self._listeners:
                try:
                    listener(report)
                except Exception:  # noqa: BLE001 - a broken listener must not stop the server
                    log.exception("server %s: batch listener %r failed", self.name, listener)

    @staticmethod
    def _deliver(pieces: list[_Piece], outputs: Any) -> list[_Request]:
        """Give each piece its rows of the outputs; returns the requests now complete."""
        leaves, tree = jax.tree_util.tree_flatten(outputs)
        single = leaves[0] if len(leaves) == 1 and tree.num_nodes == 1 else None  # one array: no unflattening
        finished = []
        at = 0
        for piece in pieces:
            rows = piece.batch.size
            request = piece.request
            part = single[at:at + rows] if single is not None else tree.unflatten([leaf[at:at + rows] for leaf in leaves])
            request.parts.append((piece.offset, part))
            at += rows
            request.rows_left -= rows
            if request.rows_left == 0:
                finished.append(request)
        return finished

    @staticmethod
    def _fail(pieces: list[_Piece], error: BaseException) -> list[_Request]:
        finished = []
        for piece in pieces:
            request = piece.request
            if request.error is None:
                request.error = error
                request.rows_left = 0
                finished.append(request)
        return finished

    @staticmethod
    def _wake(finished: list[_Request]) -> None:
        """Wake the finished callers: sync ones directly, asyncio ones with one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Request]] = {}
        for request in finished:
            if request.loop is None:
                request.done.release()
            else:
                by_loop.setdefault(request.loop, []).append(request)
        for loop, requests in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_futures, requests)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass


class _Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.shown = sys.stderr.isatty() and total > 0

    def update(self, done: int) -> None:
        if self.shown:
            filled = int(30 * done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
