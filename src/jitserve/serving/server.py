"""The in-process server: a pool of partitions that run batches taken from the queues.

Callers ask for rows (:class:`~jitserve.serving.corridor.Rows`) with
:meth:`Server.call` or :meth:`Server.stream`: the corridor submits them
(split into pieces of at most ``batch_size``) and waits on the
:class:`~jitserve.serving.request.Request` it gets back. Each partition is a worker thread with its own executor; a free
partition waits until :class:`~jitserve.serving.queue.Queues` says a queue is
ready, takes a batch from it, runs it and hands every caller its rows. The
waiting workers are the queue of free partitions, so a row passes between
threads only twice: caller to worker and back. This is Nx.Serving's loop, with
padding to compiled sizes, splitting, a bounded queue and timeouts on top.

The rooms: the lifecycle, warm-up and weights are here; submission and every
way to wait in ``corridor.py`` (the corridor, an object the server owns and
whose entry points it gives its callers); the request handle in
``request.py``; the batching policy and admission in ``queue.py``; the partitions' loop,
bisection and delivery in ``partition.py``, with the executor protocol. By
default each partition compiles the serving's function (:class:`Executor`);
the cluster coalescer gives executors that send the batch to a remote replica.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, Self

import jax

from .. import compilers
from ..batch import Batch
from ..errors import OptionError, ServerStoppedError
from ..template import is_template
from .corridor import Corridor, Rows
from .front import Front, Listener
from .options import optional_seconds
from .partition import BatchExecutor, BatchReport, BatchRunner, Partition, Weights
from .queue import BatchPolicy, Queues
from .request import Request
from .serving import Executor, Serving
from .stats import ServerStats
from .warmup import compile_each
from .worker import ProcessExecutor

log = logging.getLogger("jitserve.server")


class Server(BatchRunner, Front[Rows]):
    """A named, running server of one :class:`Serving`. Use :func:`jitserve.serve` to start one.

    ``executors`` (one per partition) replace the compiled executors of the serving's own partitions;
    ``policy`` replaces the serving's batching policy (the cluster coalescer sends rows unpadded)."""

    asks = Rows

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
        self.corridor = Corridor(name, serving, self._lock, self._cond, self._queues, self._stats,
                                 lambda: self._stopping)
        self._compiles_own = executors is None
        if executors is None:
            isolated = serving.isolation == "process"
            executors = [ProcessExecutor(serving, options, self._count_compile, f"server {name!r} partition {index}")
                         if isolated else Executor(serving, options, self._count_compile,
                                                   reuse_inputs=serving.compiles)  # user code sees no buffer
                         for index, options in enumerate(serving.partition_options())]
        self._partitions = [Partition(self._work, name, i, executor) for i, executor in enumerate(executors)]
        self._swappable = self._compiles_own and serving.has_params  # batches pin a version of weights
        self._weights = Weights([()] * len(self._partitions))
        self._update_lock = threading.Lock()

    # the entry points: the corridor's -------------------------------------------------------------

    def submit(self, batch: Batch, loop: asyncio.AbstractEventLoop | None = None, priority: int | None = None,
               stream: bool = False) -> Request:
        """Queue ``batch``'s rows; returns the request (see :meth:`Corridor.submit`)."""
        return self.corridor.submit(batch, loop, priority, stream)

    def call(self, ask: Rows) -> Any:
        """Run the rows batched with concurrent callers (see :meth:`Corridor.call`)."""
        return self.corridor.call(ask)

    async def call_async(self, ask: Rows) -> Any:
        """:meth:`call` for asyncio callers."""
        return await self.corridor.call_async(ask)

    def stream(self, ask: Rows) -> Generator[Any, None, None]:
        """:meth:`call` whose results come as they are ready (see :meth:`Corridor.stream`)."""
        return self.corridor.stream(ask)

    def stream_async(self, ask: Rows) -> AsyncGenerator[Any, None]:
        """:meth:`stream` for a caller on a running event loop."""
        return self.corridor.stream_async(ask)

    async def open_stream(self, ask: Rows) -> AsyncGenerator[Any, None]:
        """:meth:`stream_async`, its ``preprocess`` off the event loop for long texts (the network's entry)."""
        return await self.corridor.open_stream(ask)

    @property
    def servable(self) -> Serving:
        return self.serving

    # lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._swappable:
            self._weights = self._place(self.serving.params)
        self.warm_up()
        for partition in self._partitions:
            partition.thread.start()
        return self

    def warm_up(self) -> None:
        """Compile every batch size on every partition for ``input_template`` (no-op without one), and run
        each once on zeros where a first run costs extra (a GPU loads a program's kernels and builds its
        command buffers then, XLA's CPU runtime compiles them): not a caller's batch pays for it. The runs
        are not counted in the stats; a streaming serving's generator is not run."""
        signature = self.serving.template_signature()
        if signature is None or not self._compiles_own or not self.serving.compiles:
            return
        tree, row_signature = signature
        compiler = compilers.get(self.serving.compiler_name)
        runs_once = [not self.serving.streaming and compiler.first_run_costs(options)
                     for options in self.serving.partition_options()]
        zeros = Batch.stack([jax.tree_util.tree_map(lambda t: t.zeros(), self.serving.input_template,
                                                    is_leaf=is_template)])
        sizes = self.serving.batch_sizes
        keys = self.serving.batch_keys or (None,)

        def compile_one(partition: Partition, size: int, key: Any) -> None:
            partition.executor.compiled(size, tree, row_signature, key)
            if runs_once[partition.index]:
                partition.executor.execute(zeros.key(key).pad_to(size), self._weights.placed[partition.index])

        compile_each(log, f"server {self.name}", [
            (f"batch size {size}{'' if key is None else f' for batch key {key!r}'} on partition {p.index}",
             functools.partial(compile_one, p, size, key))
            for p in self._partitions for key in keys for size in sizes])

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

    @property
    def swaps_weights(self) -> bool:
        """Whether :meth:`update_params` can swap this server's weights: it runs its own batches and was
        given ``params``."""
        return self._swappable

    @property
    def params_source(self) -> str | None:
        return self.serving.params_source

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

    def listen(self, listener: Listener) -> None:
        self.add_batch_listener(listener.batch)

    def takes_weights_of(self, servable: Any) -> bool:
        return self.swaps_weights and type(servable) is type(self.serving) and servable.params is not None \
            and servable.params_template == self.serving.params_template

    def stats(self) -> ServerStats:
        """The counters so far, with the rows queued now (``queue_depth``) and the batches running
        (``in_flight``)."""
        with self._lock:
            return self._stats.snapshot(queue_depth=self._queues.depth, in_flight=self._in_flight)

    def _count_compile(self) -> None:
        with self._lock:
            self._stats.compiles += 1
