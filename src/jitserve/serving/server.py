"""The in-process server: a pool of partitions that run batches taken from the queues.

Callers :meth:`Server.submit` rows (split into pieces of at most
``batch_size``) and wait on the :class:`~jitserve.serving.queue.Request` they
get back. Each partition is a worker thread with its own executor; a free
partition waits until :class:`~jitserve.serving.queue.Queues` says a queue is
ready, takes a batch from it, runs it and hands every caller its rows. The
waiting workers are the queue of free partitions, so a row passes between
threads only twice: caller to worker and back. This is Nx.Serving's loop, with
padding to compiled sizes, splitting, a bounded queue and timeouts on top; the
batching policy itself lives in ``queue.py``.

An executor is anything with ``execute(batch) -> outputs``: by default each
partition compiles the serving's function (:class:`Executor`); the cluster
coalescer gives executors that send the batch to a remote replica instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import jax
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..batch import Batch, RowSignature
from ..errors import BatchSizeError, OptionError, QueueFullError, RequestTooLargeError, ServerStoppedError
from ..params import load_params
from .queue import BatchPolicy, Piece, Queues
from .request import END, Corridor, Request
from .serving import Executor, Serving, optional_seconds
from .worker import ProcessExecutor

log = logging.getLogger("jitserve.server")
_ABANDONED = ConnectionAbortedError("the caller stopped reading the stream")


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


@dataclass
class ServerStats:
    """A server's counters since it started (``Server.stats()`` gives them as a dict): requests taken, and
    rejected (queue full or too large), timed out, cancelled or stopped before they ran; batches and the rows
    they ran, padding included, executions per padded size, seconds waiting and executing, compiles, failed
    batches and the runs bisecting them took."""

    requests: int = 0
    batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    compiles: int = 0
    errors: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    stopped: int = 0
    bisect_runs: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # padded size -> batches
    batch_execution_s: dict[int, float] = field(default_factory=dict)  # padded size -> seconds
    queue_wait_s: float = 0.0
    execution_s: float = 0.0


class BatchExecutor(Protocol):
    """What a partition runs batches with, every method the server calls: ``compiled`` at warm-up (each batch
    size, before the first request), ``place`` for each version of the weights (what it returns is the
    ``params`` of ``execute``: ``()`` for a serving without weights, and for executors that send batches
    elsewhere), ``execute`` per batch, ``close`` once the partition's thread has ended."""

    def compiled(self, rows: int, tree: Any, row_signature: RowSignature, batch_key: Any = None) -> Any: ...

    def place(self, params: Any) -> Any: ...

    def execute(self, batch: Batch, params: Any) -> Any: ...

    def close(self) -> None: ...


class Weights:
    """One version of a serving's weights, resident on every partition (``placed[i]`` on partition ``i``'s
    device). A request is pinned to the version its first rows ran with, so that all of its rows see the
    same weights; a version is freed once neither the server nor any request pinned to it holds it."""

    __slots__ = ("placed",)

    def __init__(self, placed: list[Any]) -> None:
        self.placed = placed


def _resolve_futures(requests: list[Request]) -> None:
    """On an event loop: wake the asyncio callers whose requests finished (one hop per loop and batch)."""
    for request in requests:
        if request.future is not None and not request.future.done():
            request.future.set_result(None)


class _Partition:
    """A worker thread with its own executables."""

    def __init__(self, server: Server, index: int, executor: BatchExecutor) -> None:
        self.index = index
        self.executor = executor
        self.thread = threading.Thread(target=server._work, args=(self,), name=f"jitserve-{server.name}-p{index}",
                                       daemon=True)


class Lifecycle:
    """What every kind of server shares with the registry and ``with`` blocks: ``stop``, the callbacks run
    once it has stopped, and whether it is stopping."""

    _stopping: bool
    _on_stop: list[Callable[[Any], None]]

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        raise NotImplementedError

    def on_stop(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(server)`` once the server has stopped (the registry forgets its name)."""
        self._on_stop.append(callback)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` was called: no new requests are taken."""
        return self._stopping


class Server(Corridor, Lifecycle):
    """A named, running server of one :class:`Serving`. Use :func:`jitserve.serve` to start one.

    ``executors`` (one per partition) replace the compiled executors of the serving's own partitions;
    ``policy`` replaces the serving's batching policy (the cluster coalescer sends rows unpadded)."""

    def __init__(self, serving: Serving, name: str, executors: Sequence[BatchExecutor] | None = None,
                 policy: BatchPolicy | None = None) -> None:
        self.serving = serving
        self.name = name
        self._lock = threading.RLock()  # entered directly on the hot path (a C call, unlike the Condition's)
        self._cond = threading.Condition(self._lock)
        self._queues = Queues(policy or serving.policy)
        self._stopping = False
        self._stopped = threading.Event()
        self._in_flight = 0
        self._listeners: list[Callable[[BatchReport], None]] = []
        self._on_stop: list[Callable[[Any], None]] = []
        self._stats = ServerStats()
        self._compiles_own = executors is None
        if executors is None:
            isolated = serving.isolation == "process"
            executors = [ProcessExecutor(serving, options, self._count_compile, f"server {name!r} partition {index}")
                         if isolated else Executor(serving, options, self._count_compile,
                                                   reuse_inputs=serving.compiles)  # user code sees no buffer
                         for index, options in enumerate(serving.partition_options())]
        self._partitions = [_Partition(self, i, executor) for i, executor in enumerate(executors)]
        self._swappable = self._compiles_own and serving.has_params  # batches pin a version of weights
        self._weights = Weights([()] * len(self._partitions))
        self._update_lock = threading.Lock()

    # lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._swappable:
            self._weights = self._place(self.serving.params)
        self.warm_up()
        for partition in self._partitions:
            partition.thread.start()
        return self

    def warm_up(self) -> None:
        """Compile every batch size on every partition for ``input_template`` (no-op without one)."""
        signature = self.serving.template_signature()
        if signature is None or not self._compiles_own or not self.serving.compiles:
            return
        tree, row_signature = signature
        sizes = self.serving.batch_sizes
        keys = self.serving.batch_keys or (None,)
        work = [(p, size, key) for p in self._partitions for key in keys for size in sizes]
        label = f"{self.name}: compiling {len(sizes)} batch sizes" \
                f"{'' if keys == (None,) else f' x {len(keys)} batch keys'}"
        # tqdm on a terminal only; log lines go through it meanwhile, so the bar and the log never interleave
        with logging_redirect_tqdm(), tqdm(total=len(work), desc=label, disable=not sys.stderr.isatty(),
                                           leave=False) as progress:
            for partition, size, key in work:
                started = time.perf_counter()
                partition.executor.compiled(size, tree, row_signature, key)
                log.info("server %s: partition %d compiled batch size %d%s in %.3fs", self.name, partition.index,
                         size, "" if key is None else f" for batch key {key!r}", time.perf_counter() - started)
                progress.update(1)

    def _place(self, params: Any) -> Weights:
        return Weights([partition.executor.place(params) for partition in self._partitions])

    def update_params(self, params: Any) -> None:
        """Serve with new weights from the next batch on, compiling nothing: ``params`` must have the
        structure, shapes and dtypes of the serving's (else a TemplateMismatchError naming the leaf, and the
        old weights keep serving). Returns once they are live, on every partition: a batch formed after it
        runs with them. No batch sees a mix, and every request is answered entirely by the old or entirely
        by the new weights (a request whose first rows ran with the old ones runs the rest with them too);
        the old ones are freed when the last such request ends. Concurrent updates apply one at a time."""
        self.serving.check_params(params)
        if not self._swappable:
            raise OptionError(f"server {self.name!r} runs its batches elsewhere; update the weights where it runs")
        with self._update_lock:
            weights = self._place(params)
            with self._lock:
                self._weights = weights

    def reload_params(self) -> None:
        """:meth:`update_params` with the weights read again from the file the serving was given
        (``params=PATH``): replace that file (write a new one and rename it over the old, as
        ``save_params`` does) and reload, compiling nothing."""
        source = self.serving.params_source
        if source is None:
            raise OptionError(f"server {self.name!r} was given its weights as arrays, not as a file "
                              f"(params=PATH), so there is no file to reload them from")
        self.update_params(load_params(source))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests and end the threads once the work left is done; returns when it is.

        ``drain=True`` runs everything already queued; with ``timeout``, for at most that many seconds
        (Nx.Serving's shutdown deadline), after which every request with rows still queued gets
        :class:`ServerStoppedError` (saying whether any of its rows had run) and only the batches already
        running finish. ``drain=False`` answers every queued request none of whose rows started with
        ``ServerStoppedError`` (nothing of it ran, so a router may send it elsewhere) and finishes what
        started. A second call waits for the first one's drain."""
        optional_seconds("timeout", timeout)
        with self._lock:
            first = not self._stopping
            self._stopping = True
            finished = (self._fail_withdrawn(self._queues.withdraw_unstarted(), "stopped before this request started")
                        if first and not drain else [])
            self._cond.notify_all()
        self._wake(finished)
        if not first:
            self._stopped.wait()
            return
        if drain and timeout is not None:
            deadline = time.monotonic() + timeout
            for partition in self._partitions:
                partition.thread.join(max(deadline - time.monotonic(), 0))
            with self._lock:
                finished = self._fail_withdrawn(self._queues.withdraw_all(),
                                                f"stopped (its drain timeout of {timeout}s ran out) before all of "
                                                f"this request ran")
            self._wake(finished)
        for partition in self._partitions:
            partition.thread.join()
            partition.executor.close()
        for callback in self._on_stop:
            callback(self)
        self._stopped.set()

    def _fail_withdrawn(self, requests: list[Request], reason: str) -> list[Request]:
        """Under the lock: answer requests taken off the queues at a stop with ServerStoppedError (the
        reason, and whether any of their rows had run); returns them, to wake."""
        finished = []
        for request in requests:
            ran = "some of its rows had run, the rest never will" if request.started else "nothing of it ran"
            if request.fail(ServerStoppedError(f"server {self.name!r} {reason}; {ran}")):
                finished.append(request)
        self._stats.stopped += len(finished)
        return finished

    @property
    def partitions(self) -> int:
        """How many batches can run at once."""
        return len(self._partitions)

    @property
    def queue_depth(self) -> int:
        """Rows waiting now (read without the lock: a hint for routers, not an exact count)."""
        return self._queues.depth

    def add_batch_listener(self, listener: Callable[[BatchReport], None]) -> None:
        """Call ``listener(report)`` in the worker thread after every executed batch."""
        self._listeners.append(listener)

    def stats(self) -> dict[str, Any]:
        """The counters of :class:`ServerStats` as a dict, with the rows queued now (``queue_depth``) and the
        batches running (``in_flight``)."""
        with self._lock:
            return {**dataclasses.asdict(self._stats), "queue_depth": self._queues.depth,
                    "in_flight": self._in_flight}

    def _count_compile(self) -> None:
        with self._lock:
            self._stats.compiles += 1

    # callers ---------------------------------------------------------------------------------

    def submit(self, batch: Batch, loop: asyncio.AbstractEventLoop | None = None,
               priority: int | None = None, stream: bool = False) -> Request:
        """Queue the batch's rows (split into pieces of at most ``batch_size``) at ``priority`` (1 is the
        most urgent level; None or 0: the serving's default); returns the request.

        Give the running ``loop`` for a caller that will await :meth:`result_async` or read
        :meth:`stream_async`; ``stream=True`` for a caller that reads the results as they come."""
        serving = self.serving
        size = batch.size
        serving.check_key(batch)
        level = serving.priority_level(priority)
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

    # partitions ------------------------------------------------------------------------------

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
                self._cond.wait(wait)
            pieces, batch = queues.take(signature, time.monotonic())
            weights = self._pin(pieces) if self._swappable else self._weights
            self._in_flight += 1
            if queues:
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

    def _work(self, partition: _Partition) -> None:
        while (work := self._next_batch()) is not None:
            self._execute(partition, *work)

    def _execute(self, partition: _Partition, pieces: list[Piece], batch: Batch, weights: Weights | None,
                 formed: float) -> None:
        started = time.perf_counter()
        outcomes: list[tuple[list[Piece], Any, BaseException | None]] = []
        reruns = 0
        error: BaseException | None = None
        runs = [(pieces, batch, weights)] if weights is not None else self._runs_by_weights(pieces)
        for run_pieces, run_batch, run_weights in runs:
            run_outcomes, run_reruns, run_error = self._run(partition, run_pieces, run_batch,
                                                            run_weights.placed[partition.index])
            outcomes += run_outcomes
            reruns += run_reruns
            error = error or run_error
        elapsed = time.perf_counter() - started
        padded = batch.size + batch.padding
        wait = sum(formed - piece.enqueued for piece in pieces)
        report = BatchReport(self.name, partition.index, batch.size, padded,
                             max(formed - piece.enqueued for piece in pieces), elapsed, error)
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
            stats.batch_execution_s[padded] = stats.batch_execution_s.get(padded, 0.0) + elapsed
            stats.queue_wait_s += wait
            stats.execution_s += elapsed
            stats.errors += error is not None
            self._in_flight -= 1
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

    def _run(self, partition: _Partition, pieces: list[Piece], batch: Batch, params: Any
             ) -> tuple[list[tuple[list[Piece], Any, BaseException | None]], int, BaseException | None]:
        """Run one batch with ``params``: the outcomes per group of pieces (one group, unless a failure was
        bisected), the re-runs that took, and the batch's error if it failed."""
        outputs: Any = None
        try:
            outputs = partition.executor.execute(batch, params)
            if self.serving.streaming:  # each step reaches the callers as soon as the serving yields it
                for step, step_outputs in enumerate(outputs):
                    with self._lock:
                        if not self._deliver_step(pieces, step, step_outputs):
                            break
                outputs.close()  # a generator nobody reads any more stops here (its finally blocks run)
                outputs = None
        except BaseException as failure:  # noqa: BLE001 - delivered to exactly the callers of this batch
            if self.serving.isolate_failures and not self.serving.streaming:
                return *self._bisect(partition, pieces, failure, params), failure
            return [(pieces, None, failure)], 0, failure
        return [(pieces, outputs, None)], 0, None

    def _bisect(self, partition: _Partition, pieces: list[Piece], error: BaseException, params: Any
                ) -> tuple[list[tuple[list[Piece], Any, BaseException | None]], int]:
        """A batch failed: re-run its requests in halves so that only requests whose own rows fail get an
        error. Each request's pieces stay together. If both halves of the first split fail too, the function
        fails whatever the rows and everyone gets the original error; re-runs stop after 2 x log2(requests)
        + 2, the rest getting their last error. Returns (pieces, outputs, error) groups and the re-run count."""
        groups: dict[int, list[Piece]] = {}
        for piece in pieces:
            groups.setdefault(id(piece.request), []).append(piece)
        requests = list(groups.values())
        budget = 2 * max(len(requests) - 1, 1).bit_length() + 2
        outcomes: list[tuple[list[Piece], Any, BaseException | None]] = []
        reruns = 0

        def flat(part: list[list[Piece]]) -> list[Piece]:
            return [piece for group in part for piece in group]

        def split(part: list[list[Piece]], failure: BaseException, top: bool) -> None:
            nonlocal reruns
            if len(part) == 1 or reruns >= budget:
                outcomes.append((flat(part), None, failure))
                return
            middle = len(part) // 2
            halves: list[tuple[list[list[Piece]], Any, BaseException | None]] = []
            for half in (part[:middle], part[middle:]):
                reruns += 1
                try:
                    halves.append((half, partition.executor.execute(self._queues.policy.join(flat(half)), params),
                                   None))
                except BaseException as half_failure:  # noqa: BLE001 - sorted below
                    halves.append((half, None, half_failure))
            if top and all(half_error is not None for _, _, half_error in halves):
                outcomes.append((flat(part), None, failure))  # it fails whatever the rows: no deeper
                return
            for half, half_outputs, half_error in halves:
                if half_error is None:
                    outcomes.append((flat(half), half_outputs, None))
                else:
                    split(half, half_error, top=False)

        split(requests, error, top=True)
        return outcomes, reruns

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
        parts = self._pieces_of(pieces, outputs) if outputs is not None else ((piece, None) for piece in pieces)
        for piece, part in parts:
            request = piece.request
            if request.error is not None:  # another part of it failed: its caller has the error already
                continue
            if part is not None:
                if request.stream is not None:
                    request.stream.put((piece.offset, part))
                else:
                    request.parts.append((piece.offset, part))
            request.reports.append(report)
            request.rows_left -= piece.batch.size
            if request.rows_left == 0:
                finished.append(request)
                if request.stream is not None:
                    request.stream.put(END)
        return finished

    def _deliver_step(self, pieces: list[Piece], step: int, outputs: Any) -> bool:
        """One step a streaming serving yielded: each caller's rows of it, to its stream or its parts. False
        when none of the callers is waiting any more (each stopped reading): no more steps are wanted."""
        wanted = False
        for piece, part in self._pieces_of(pieces, outputs):
            request = piece.request
            if request.error is not None:
                continue
            wanted = True
            if request.stream is not None:
                request.stream.put((step, part))
            else:
                request.parts.append((step, part))
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
                loop.call_soon_threadsafe(_resolve_futures, requests)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass
