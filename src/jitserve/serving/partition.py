"""The batch-running half of a server: partitions (a worker thread and an executor each) take batches from
the queues, run them, bisect a failed batch down to the request that broke it, and hand every caller its
rows.

:class:`BatchRunner` is the part of :class:`~jitserve.serving.server.Server` that runs on the partitions'
threads; the executor protocol (:class:`BatchExecutor`) is every method it calls; a batch's outcome is told
to listeners as a :class:`BatchReport`, and the counters are a :class:`~jitserve.serving.stats.ServerStats`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from ..batch import Batch, RowSignature
from .queue import Piece, Queues
from .request import END, Request, Stream, put_all, resolve_futures
from .serving import Serving
from .stats import NO_TIME, Phases, ServerStats

log = logging.getLogger("jitserve.server")


@dataclass(frozen=True)
class BatchReport:
    """What one executed batch did: given to every batch listener after it ran, and to a serving's
    ``postprocess`` as the metadata of the batches that ran a request's rows."""

    server: str
    partition: int
    size: int
    padded_size: int
    queue_wait_s: float
    execution_s: float
    error: BaseException | None
    queue_waits_s: tuple[float, ...] = ()  # each request's wait (each part's, of a split one); the longest above
    formed_at: float = 0.0  # when the batch was formed (time.monotonic)
    traces: tuple[Any, ...] = ()  # each request's trace context (request.TRACE), aligned with queue_waits_s
    phases: Phases = NO_TIME  # execution_s as Triton splits it: inputs, the executable, outputs


class BatchExecutor(Protocol):
    """What a partition runs batches with, every method the server calls: ``compiled`` at warm-up (each batch
    size, before the first request), ``place`` for each version of the weights (what it returns is the
    ``params`` of ``execute``: ``()`` for a serving without weights, and for executors that send batches
    elsewhere), ``execute`` per batch (its outputs, cut to the batch's rows, and the :class:`Phases` it
    took), ``close`` once the partition's thread has ended."""

    def compiled(self, rows: int, tree: Any, row_signature: RowSignature, batch_key: Any = None) -> Any: ...

    def place(self, params: Any) -> Any: ...

    def execute(self, batch: Batch, params: Any) -> tuple[Any, Phases]: ...

    def close(self) -> None: ...


class Weights:
    """One version of a serving's weights, resident on every partition (``placed[i]`` on partition ``i``'s
    device). A request is pinned to the version its first rows ran with, so that all of its rows see the
    same weights; a version is freed once neither the server nor any request pinned to it holds it."""

    __slots__ = ("placed",)

    def __init__(self, placed: list[Any]) -> None:
        self.placed = placed


class Partition:
    """A worker thread with its own executor, running ``work(partition)``."""

    def __init__(self, work: Callable[[Partition], None], name: str, index: int, executor: BatchExecutor) -> None:
        self.index = index
        self.executor = executor
        self.thread = threading.Thread(target=work, args=(self,), name=f"jitserve-{name}-p{index}", daemon=True)


class BatchRunner:
    """What a server's partitions do (mixed into :class:`~jitserve.serving.server.Server`, whose state it
    shares under the server's lock)."""

    serving: Serving
    name: str
    _lock: threading.RLock
    _cond: threading.Condition
    _queues: Queues
    _stopping: bool
    _swappable: bool
    _weights: Weights
    _in_flight: int
    _stats: ServerStats
    _listeners: list[Callable[[BatchReport], None]]

    def _next_batch(self) -> tuple[list[Piece], Batch, Weights | None, float] | None:
        """Wait for a queue to be ready and take a batch from it, with the weights it runs with (None: its
        requests are pinned to different versions); None once stopped and drained."""
        queues = self._queues
        with self._lock:
            while True:
                signature, wait = queues.ready(time.monotonic(), self._stopping)
                if signature is not None:
                    break
                if self._stopping and not queues:
                    return None
                queues.waiting += 1
                self._cond.wait(wait)
                queues.waiting -= 1
            pieces, batch = queues.take(signature, time.monotonic())
            weights = self._pin(pieces) if self._swappable else self._weights
            self._in_flight += 1
            if queues and queues.waiting:
                self._cond.notify()  # more rows are waiting: another free partition may take them
        return pieces, batch, weights, time.monotonic()

    def _pin(self, pieces: list[Piece]) -> Weights | None:
        """Under the lock: the weights a batch runs with: those a request among it already ran with (the
        rest of its rows must see them too), else the current ones, to which its new requests are pinned.
        None when its requests are pinned to different versions (rare: updates while a split request of a
        lower priority waits); the batch then runs once per version."""
        chosen = None
        mixed = False
        for piece in pieces:
            pinned = piece.request.weights
            if pinned is not None and pinned is not chosen:
                mixed = chosen is not None
                if mixed:
                    break
                chosen = pinned
        chosen = chosen or self._weights
        for piece in pieces:
            if piece.request.weights is None:
                piece.request.weights = chosen
        return None if mixed else chosen

    # workers ---------------------------------------------------------------------------------

    def _work(self, partition: Partition) -> None:
        while (work := self._next_batch()) is not None:
            self._execute(partition, *work)
            del work  # the batch and its requests' arrays go now, not once the next batch comes

    def _execute(self, partition: Partition, pieces: list[Piece], batch: Batch, weights: Weights | None,
                 formed: float) -> None:
        started = time.perf_counter()
        outcomes: list[tuple[list[Piece], Any, BaseException | None]] = []
        reruns = 0
        error: BaseException | None = None
        phases = NO_TIME
        runs = [(pieces, batch, weights)] if weights is not None else self._runs_by_weights(pieces)
        for run_pieces, run_batch, run_weights in runs:
            run_outcomes, run_reruns, run_error, run_phases = self._run(partition, run_pieces, run_batch,
                                                                        run_weights.placed[partition.index])
            outcomes += run_outcomes
            reruns += run_reruns
            error = error or run_error
            phases = run_phases if phases is NO_TIME else phases + run_phases
        elapsed = time.perf_counter() - started
        padded = batch.size + batch.padding
        waits = tuple([formed - piece.enqueued for piece in pieces])
        report = BatchReport(self.name, partition.index, batch.size, padded, max(waits), elapsed, error, waits, formed,
                             tuple([piece.request.trace for piece in pieces]), phases)
        with self._lock:  # a split request's parts may finish on several partitions at once
            finished = []
            for part, part_outputs, part_error in outcomes:
                finished += (self._deliver(part, part_outputs, report) if part_error is None
                             else self._fail(part, part_error))
            stats = self._stats
            stats.bisect_runs += reruns
            stats.batches += 1
            stats.rows += batch.size
            stats.padded_rows += batch.padding
            stats.batch_sizes[padded] = stats.batch_sizes.get(padded, 0) + 1
            stats.batch_phases[padded] = stats.batch_phases.get(padded, NO_TIME) + phases
            stats.queue_wait_s += sum(waits)
            stats.execution_s += elapsed
            stats.errors += error is not None
            self._in_flight -= 1
            self._queues.finished(batch.size)
        self._wake(finished)
        if self._listeners:
            for listener in self._listeners:
                try:
                    listener(report)
                except Exception:
                    log.exception("server %s: batch listener %r failed", self.name, listener)

    def _runs_by_weights(self, pieces: list[Piece]) -> list[tuple[list[Piece], Batch, Weights]]:
        """A batch's pieces as one batch per version of the weights their requests are pinned to."""
        groups: dict[int, tuple[list[Piece], Weights]] = {}
        for piece in pieces:
            groups.setdefault(id(piece.request.weights), ([], piece.request.weights))[0].append(piece)
        return [(group, self._queues.policy.join(group), weights) for group, weights in groups.values()]

    def _run(self, partition: Partition, pieces: list[Piece], batch: Batch, params: Any
             ) -> tuple[list[tuple[list[Piece], Any, BaseException | None]], int, BaseException | None, Phases]:
        """Run one batch with ``params``: the outcomes per group of pieces (one group, unless a failure was
        bisected), the re-runs that took, the batch's error if it failed, and the phases of its runs (a run
        that failed, and the steps of a serving that yields them, counted as infer)."""
        outputs: Any = None
        started = time.perf_counter()
        phases = NO_TIME
        try:
            outputs, phases = partition.executor.execute(batch, params)
            if self.serving.streaming:  # each step reaches the callers as soon as the serving yields it
                stepping = time.perf_counter()
                for step, step_outputs in enumerate(outputs):
                    with self._lock:
                        if not self._deliver_step(pieces, step, step_outputs):
                            break
                outputs.close()  # a generator nobody reads any more stops here (its finally blocks run)
                outputs = None
                phases += Phases(infer_s=time.perf_counter() - stepping)
        except BaseException as failure:  # noqa: BLE001 - delivered to exactly the callers of this batch
            phases = Phases(infer_s=time.perf_counter() - started)
            if self.serving.isolate_failures and not self.serving.streaming:
                outcomes, reruns, rerun_phases = self._bisect(partition, pieces, failure, params)
                return outcomes, reruns, failure, phases + rerun_phases
            return [(pieces, None, failure)], 0, failure, phases
        return [(pieces, outputs, None)], 0, None, phases

    def _bisect(self, partition: Partition, pieces: list[Piece], error: BaseException, params: Any
                ) -> tuple[list[tuple[list[Piece], Any, BaseException | None]], int, Phases]:
        """A batch failed: re-run its requests in halves so that only requests whose own rows fail get an
        error. Each request's pieces stay together. If both halves of the first split fail too, the function
        fails whatever the rows and everyone gets the original error; re-runs stop after 2 x log2(requests)
        + 2, the rest getting their last error. Returns (pieces, outputs, error) groups, the re-run count and
        the re-runs' phases."""
        groups: dict[int, list[Piece]] = {}
        for piece in pieces:
            groups.setdefault(id(piece.request), []).append(piece)
        requests = list(groups.values())
        budget = 2 * max(len(requests) - 1, 1).bit_length() + 2
        outcomes: list[tuple[list[Piece], Any, BaseException | None]] = []
        reruns = 0
        phases = NO_TIME

        def flat(part: list[list[Piece]]) -> list[Piece]:
            return [piece for group in part for piece in group]

        def split(part: list[list[Piece]], failure: BaseException, top: bool) -> None:
            nonlocal reruns, phases
            if len(part) == 1 or reruns >= budget:
                outcomes.append((flat(part), None, failure))
                return
            middle = len(part) // 2
            halves: list[tuple[list[list[Piece]], Any, BaseException | None]] = []
            for half in (part[:middle], part[middle:]):
                reruns += 1
                started = time.perf_counter()
                try:
                    half_outputs, half_phases = partition.executor.execute(self._queues.policy.join(flat(half)),
                                                                           params)
                    halves.append((half, half_outputs, None))
                except BaseException as half_failure:  # noqa: BLE001 - sorted below
                    half_phases = Phases(infer_s=time.perf_counter() - started)
                    halves.append((half, None, half_failure))
                phases += half_phases
            if top and all(half_error is not None for _, _, half_error in halves):
                outcomes.append((flat(part), None, failure))  # it fails whatever the rows: no deeper
                return
            for half, half_outputs, half_error in halves:
                if half_error is None:
                    outcomes.append((flat(half), half_outputs, None))
                else:
                    split(half, half_error, top=False)

        split(requests, error, top=True)
        return outcomes, reruns, phases

    @staticmethod
    def _pieces_of(pieces: list[Piece], outputs: Any) -> Iterator[tuple[Piece, Any]]:
        """Each piece with its rows of the outputs."""
        leaves, structure = jax.tree_util.tree_flatten(outputs)
        tree: Any = structure  # jaxlib's PyTreeDef, which its stubs do not export
        single = leaves[0] if len(leaves) == 1 and tree.num_nodes == 1 else None  # one array: no unflattening
        at = 0
        for piece in pieces:
            start, at = at, at + piece.batch.size
            yield piece, single[start:at] if single is not None else tree.unflatten([leaf[start:at] for leaf in leaves])

    def _deliver(self, pieces: list[Piece], outputs: Any, report: BatchReport) -> list[Request]:
        """Give each piece its rows of the outputs (and the batch's report); returns the requests now
        complete. (A serving that yields steps delivered them already: only the report and the count.)"""
        finished = []
        deliveries: list[tuple[Stream, Any]] = []
        whole = rows = 0  # of the requests that ran in this batch alone: how many, their rows, their queue waits
        waited = 0.0
        parts = self._pieces_of(pieces, outputs) if outputs is not None else ((piece, None) for piece in pieces)
        for piece, part in parts:
            request = piece.request
            if request.error is not None:  # another part of it failed: its caller has the error already
                continue
            if part is not None:
                if request.stream is not None:
                    deliveries.append((request.stream, (piece.offset, part)))
                else:
                    request.parts.append((piece.offset, part))
            request.reports.append(report)
            request.rows_left -= piece.batch.size
            if request.rows_left == 0:
                finished.append(request)
                if len(request.reports) == 1:  # counted below, with the others of this batch
                    whole += 1
                    rows += request.rows
                    waited += report.formed_at - piece.enqueued
                else:
                    self._count_completed(request, piece.enqueued)
                if request.stream is not None:
                    deliveries.append((request.stream, END))
        if deliveries:
            put_all(deliveries)
        if whole:
            stats = self._stats
            stats.completed += whole
            stats.completed_rows += rows
            stats.completed_queue_s += waited
            stats.completed_phases += report.phases.times(whole)
        return finished

    def _count_completed(self, request: Request, enqueued: float) -> None:
        """Under the lock: a request whose rows ran in several batches, counted as Triton counts a request:
        its wait from ``enqueued`` until its first batch was formed, and the phases of each batch that ran
        some of its rows, one after another. (Those that ran in one batch :meth:`_deliver` counts at once.)"""
        stats = self._stats
        stats.completed += 1
        stats.completed_rows += request.rows
        reports = request.reports
        batches = {id(report): report for report in reports}.values()  # a batch may hold two of its pieces
        stats.completed_queue_s += min(report.formed_at for report in batches) - enqueued
        for report in batches:
            stats.completed_phases += report.phases

    def _deliver_step(self, pieces: list[Piece], step: int, outputs: Any) -> bool:
        """One step a streaming serving yielded: each caller's rows of it, to its stream or its parts. False
        when none of the callers is waiting any more (each stopped reading): no more steps are wanted."""
        wanted = False
        deliveries: list[tuple[Stream, Any]] = []
        for piece, part in self._pieces_of(pieces, outputs):
            request = piece.request
            if request.error is not None:
                continue
            wanted = True
            if request.stream is not None:
                deliveries.append((request.stream, (step, part)))
            else:
                request.parts.append((step, part))
        put_all(deliveries)
        return wanted

    @staticmethod
    def _fail(pieces: list[Piece], error: BaseException) -> list[Request]:
        return [piece.request for piece in pieces if piece.request.fail(error)]

    @staticmethod
    def _wake(finished: list[Request]) -> None:
        """Wake the finished callers: sync ones directly, asyncio ones with one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
        for request in finished:
            if request.loop is None:
                request.done.release()
            else:
                by_loop.setdefault(request.loop, []).append(request)
        for loop, requests in by_loop.items():
            try:
                loop.call_soon_threadsafe(resolve_futures, requests)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass
