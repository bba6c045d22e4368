"""The whole batching policy in one place: the queues per batch signature, and what runs next.

A request's rows (a :class:`~jitserve.serving.request.Request`) are queued as
:class:`Piece` s of at most ``batch_size`` rows on the queue of their batch
signature (key, structure, per-row shapes and
dtypes), at their priority level. :class:`Queues` decides which queue is
ready (full, its oldest row has waited ``batch_timeout``, the server is
draining, or, with the adaptive window, the arrival rate says it will not fill
in time and no rows the recent load had in flight are still to come), takes
rows from it (the most urgent first, ``BatchPolicy.rows_to_take``, splitting a
piece that does not fit), pads them to a compiled size
(``BatchPolicy.padded_size``), and takes requests back off the queues
(timeouts, cancelled callers, a stop without drain). It holds no lock of its
own: the server calls it under its condition.

Priorities follow Triton: level 1 is the most urgent, ``priority_levels`` the
least; within a level, arrival order. A piece waiting ``priority_aging``
seconds moves up one level, so a request of level L competes at level 1 after
at most (L - 1) x ``priority_aging`` seconds: no level starves.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..batch import Batch
from ..errors import QueueFullError, RequestTooLargeError
from .request import Request

Signature = tuple[Any, ...]
# the adaptive window's memory of how many rows were in flight at once: it halves every this many batch_timeouts
PEAK_HALF_LIFE_WINDOWS = 4
FORMING_FRACTION = 4  # a quarter of batch_size: rows worth a batch of their own under load


class Piece:
    """Rows ``offset:offset + batch.size`` of a request, queued at ``enqueued`` (monotonic seconds)."""

    __slots__ = ("request", "offset", "batch", "enqueued")

    def __init__(self, request: Request, offset: int, batch: Batch, enqueued: float) -> None:
        self.request = request
        self.offset = offset
        self.batch = batch
        self.enqueued = enqueued


@dataclass(frozen=True)
class BatchPolicy:
    """How a server forms batches: at most ``batch_size`` rows, padded to one of ``batch_sizes`` (when
    ``pad``), run when full or when the oldest row has waited ``batch_timeout`` seconds (sooner with
    ``adaptive`` when the batch will not fill); at most ``max_queue`` rows wait (None: no bound), and at
    most ``level_max_queue[level]`` of one priority level."""

    batch_size: int
    batch_sizes: Sequence[int]
    batch_timeout: float
    max_queue: int | None = None
    pad: bool = True
    priority_levels: int = 1
    priority_aging: float = 1.0
    level_max_queue: tuple[tuple[int, int], ...] = ()
    adaptive: bool = True
    whole_requests: bool = False  # never split a request across batches (a serving that yields steps)

    def padded_size(self, rows: int) -> int:
        """The compiled batch size a batch of ``rows`` rows is padded to (``rows`` itself without padding)."""
        if not self.pad:
            return rows
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows)]

    def rows_to_take(self, queued: int) -> int:
        """How many of ``queued`` rows run next: ``batch_size`` when there are that many; else all of them,
        unless padding them up would waste more rows than cutting down to the next smaller compiled size
        leaves for the next batch (33 queued with sizes 32 and 64: run 32, not 33 padded to 64)."""
        if queued >= self.batch_size:
            return self.batch_size
        position = bisect.bisect_left(self.batch_sizes, queued)
        up = self.batch_sizes[position]
        down = self.batch_sizes[position - 1] if up != queued and position > 0 else queued
        return down if up - queued > queued - down else queued

    def join(self, pieces: Sequence[Piece]) -> Batch:
        """The pieces' rows as one batch, padded to its compiled size."""
        batch = Batch.join([piece.batch for piece in pieces])
        batch.padding = self.padded_size(batch.size) - batch.size
        return batch

    def urgency(self, piece: Piece, now: float) -> tuple[int, float]:
        """Which piece runs first: its level, moved up one per ``priority_aging`` seconds waited (never
        above 1), then arrival."""
        level = piece.request.level
        if level > 1:
            level = max(1, level - int((now - piece.enqueued) / self.priority_aging))
        return level, piece.enqueued


class _SignatureQueue:
    """The pieces of one batch signature: a FIFO deque per priority level."""

    __slots__ = ("levels", "rows")

    def __init__(self) -> None:
        self.levels: dict[int, deque[Piece]] = {}
        self.rows = 0

    def oldest(self) -> float:
        levels = self.levels
        if len(levels) == 1:  # one priority level: its head
            (queue,) = levels.values()
            return queue[0].enqueued
        return min(queue[0].enqueued for queue in levels.values())

    def best(self, policy: BatchPolicy, now: float) -> tuple[tuple[int, float], deque[Piece]]:
        """The most urgent head of any level, and its deque."""
        return min(((policy.urgency(queue[0], now), queue) for queue in self.levels.values()),
                   key=lambda pair: pair[0])

    def pieces(self) -> list[Piece]:
        return [piece for queue in self.levels.values() for piece in queue]

    def drop_empty(self) -> None:
        for level in [level for level, queue in self.levels.items() if not queue]:
            del self.levels[level]


class Queues:
    """The queues of pieces per batch signature, and the rows queued in each, per level and in all."""

    __slots__ = ("policy", "level_limits", "_queues", "depth", "level_depth", "running", "_last_arrival",
                 "_seconds_per_row", "_peak", "_peak_at", "_peak_half_life", "_formed", "wake_at", "waiting")

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self.level_limits = dict(policy.level_max_queue)  # priority level -> its max_queue
        self._queues: dict[Signature, _SignatureQueue] = {}
        self.depth = 0
        self.level_depth: dict[int, int] = {}
        self.running = 0  # rows taken by workers whose batches have not finished (see ``finished``)
        self._last_arrival: float | None = None
        self._seconds_per_row: float | None = None  # the arrival gap per row, smoothed (the adaptive window)
        self._peak = 0.0  # the most rows queued and running at once lately, decaying (the adaptive window)
        self._peak_at = 0.0
        self._peak_half_life = PEAK_HALF_LIFE_WINDOWS * policy.batch_timeout
        self._formed = math.ceil(policy.batch_size / FORMING_FRACTION)  # rows worth a batch of their own
        self.wake_at = math.inf  # when a waiting worker looks at the queues next on its own (see ``ready``)
        self.waiting = 0  # workers waiting on the server's condition: with none, no arrival needs to wake one

    def __bool__(self) -> bool:
        return bool(self._queues)

    def admit(self, size: int, level: int, server: str) -> None:
        """Admission: raise unless ``size`` more rows at ``level`` fit the queue bounds (``max_queue``, and
        the level's own): ``RequestTooLargeError`` for a request no bound can ever hold, ``QueueFullError``
        (retryable) for one that does not fit now."""
        max_queue, level_limit = self.policy.max_queue, self.level_limits.get(level)
        if max_queue is None and level_limit is None:
            return
        for limit, which in [(max_queue, "max_queue"), (level_limit, f"priority level {level}'s max_queue")]:
            if limit is not None and size > limit:
                raise RequestTooLargeError(f"a request of {size} rows can never fit server {server!r}'s "
                                           f"queue: {which} is {limit} rows")
        if max_queue is not None and self.depth + size > max_queue:
            raise QueueFullError(f"server {server!r} queue is full: {self.depth} rows queued, max_queue is "
                                 f"{max_queue}; a request of {size} rows was rejected")
        if level_limit is not None and (queued := self.level_depth.get(level, 0)) + size > level_limit:
            raise QueueFullError(f"server {server!r} queue for priority level {level} is full: {queued} rows "
                                 f"queued, its max_queue is {level_limit}; a request of {size} rows was rejected")

    def add(self, request: Request, parts: Sequence[Batch], signature: Signature, now: float) -> bool:
        """Queue a request's parts (consecutive row ranges). True when a waiting worker must look now:
        the queue was empty (a new deadline), now holds a full batch, or the window is adaptive (never
        while no worker waits)."""
        queue = self._queues.get(signature)
        if queue is None:
            queue = self._queues[signature] = _SignatureQueue()
        level_queue = queue.levels.get(request.level)
        if level_queue is None:
            level_queue = queue.levels[request.level] = deque()
        queued = queue.rows
        offset = 0
        for part in parts:
            level_queue.append(Piece(request, offset, part, now))
            offset += part.size
        queue.rows = queued + offset
        self.depth += offset
        self.level_depth[request.level] = self.level_depth.get(request.level, 0) + offset
        self._arrived(offset, now)
        return self.waiting > 0 and self._run_at(queue) < self.wake_at

    def _arrived(self, rows: int, now: float) -> None:
        """The arrival rate and the peak of rows in flight (queued and running), for the adaptive window."""
        half_life = self._peak_half_life
        decayed = self._peak * 0.5 ** ((now - self._peak_at) / half_life) if half_life > 0 else 0.0
        self._peak, self._peak_at = max(self.depth + self.running, decayed), now
        if self._last_arrival is not None:
            gap = (now - self._last_arrival) / rows
            previous = self._seconds_per_row
            self._seconds_per_row = gap if previous is None else 0.8 * previous + 0.2 * gap
        self._last_arrival = now

    def _run_at(self, queue: _SignatureQueue) -> float:
        """When a queue is to run: now when it holds a full batch; else when its oldest row has waited
        ``batch_timeout``, or (adaptive, the arrival rate known) sooner: from the moment when the rows still
        missing would, at that rate, arrive only after then (it will not fill in time); but while the queue
        holds less than a quarter of ``batch_size`` and the peak of rows in flight (queued and running) at
        once lately was at least that, not before the rows still to come (that peak, less those in flight
        now) have had time to arrive at that rate. A lone caller has none to come, so its row runs at
        once; callers that keep many requests in flight (a gRPC client's streams, a load generator) get
        batches worth running even when each of their requests reaches the queue alone."""
        policy = self.policy
        missing = policy.batch_size - queue.rows
        if missing <= 0:
            return -math.inf
        due = queue.oldest() + policy.batch_timeout
        per_row = self._seconds_per_row
        if not policy.adaptive or per_row is None:  # unknown rate: wait as a fixed window does
            return due
        will_not_fill = due - missing * per_row
        formed = self._formed
        coming = min(int(self._peak + 0.5) - self.depth - self.running, formed - queue.rows)
        if coming <= 0 or self._peak < formed:
            return will_not_fill
        assert self._last_arrival is not None, "a rate is known once two rows arrived"
        return max(will_not_fill, min(due, self._last_arrival + coming * per_row))

    def ready(self, now: float, draining: bool) -> tuple[Signature | None, float | None]:
        """The queue to run now (full, due, draining, or not going to fill in time; the most urgent head
        first), else how long to wait. A worker about to wait sets ``wake_at``: an arrival that makes a
        queue due sooner than that is what ``add`` reports, so that a waiting worker wakes once per batch
        rather than once per request; a worker that runs a batch sets it to infinity (report every
        arrival), as a free worker may be waiting on an older plan."""
        if len(self._queues) == 1:  # one queue: no urgencies to compare
            ((signature, queue),) = self._queues.items()
            run_at = self._run_at(queue)
            if draining or run_at <= now:
                self.wake_at = math.inf
                return signature, None
            self.wake_at = run_at
            return None, run_at - now
        best = best_urgency = wait = None
        for signature, queue in self._queues.items():
            run_at = self._run_at(queue)
            if draining or run_at <= now:
                urgency = queue.best(self.policy, now)[0]
                if best_urgency is None or urgency < best_urgency:
                    best, best_urgency = signature, urgency
            elif wait is None or run_at - now < wait:
                wait = run_at - now
        self.wake_at = math.inf if best is not None or wait is None else now + wait
        return best, wait

    def take(self, signature: Signature, now: float) -> tuple[list[Piece], Batch]:
        """Rows from one queue, most urgent first (``rows_to_take``, splitting the last piece if needed, or
        leaving it whole for the next batch with ``whole_requests``), their requests marked started, joined
        into one batch padded to its compiled size."""
        queue = self._queues[signature]
        policy = self.policy
        levels = queue.levels
        space = policy.rows_to_take(queue.rows)
        taken: list[Piece] = []
        while space and levels:
            one_level = len(levels) == 1  # its pieces in arrival order, without comparing heads
            level_queue = next(iter(levels.values())) if one_level else queue.best(policy, now)[1]
            while True:
                piece = level_queue[0]
                if piece.batch.size > space and policy.whole_requests and taken:
                    space = 0  # its steps must come from one batch: it waits for the next
                    break
                if piece.batch.size > space and not policy.whole_requests:
                    head, tail = piece.batch.split(space)
                    level_queue[0] = Piece(piece.request, piece.offset + space, tail, piece.enqueued)
                    piece = Piece(piece.request, piece.offset, head, piece.enqueued)
                else:
                    level_queue.popleft()
                piece.request.started = True
                taken.append(piece)
                space = max(space - piece.batch.size, 0)
                if not (one_level and space and level_queue):
                    break
            if not level_queue:
                queue.drop_empty()
        self._forget(signature, taken)
        batch = policy.join(taken)
        self.running += batch.size
        return taken, batch

    def finished(self, rows: int) -> None:
        """A batch of ``rows`` rows that ``take`` gave has finished running (its callers are answered)."""
        self.running -= rows

    def withdraw(self, request: Request) -> None:
        """Take every queued piece of ``request`` off the queues."""
        self._remove(lambda piece: piece.request is request)

    def withdraw_unstarted(self) -> list[Request]:
        """Take every request none of whose rows started off the queues (a stop without drain); the
        pieces of started requests stay, so that no request runs only in part."""
        return self._requests_of(self._remove(lambda piece: not piece.request.started))

    def withdraw_all(self) -> list[Request]:
        """Take every queued piece off the queues (a drain deadline passed); the requests they belong to."""
        return self._requests_of(self._remove(lambda piece: True))

    @staticmethod
    def _requests_of(pieces: list[Piece]) -> list[Request]:
        return list({id(piece.request): piece.request for piece in pieces}.values())

    def _remove(self, chosen: Callable[[Piece], bool]) -> list[Piece]:
        """Take the ``chosen`` pieces off every queue; returns them."""
        removed = []
        for signature, queue in list(self._queues.items()):
            pieces = [piece for piece in queue.pieces() if chosen(piece)]
            for piece in pieces:
                queue.levels[piece.request.level].remove(piece)
            queue.drop_empty()
            self._forget(signature, pieces)
            removed += pieces
        return removed

    def _forget(self, signature: Signature, pieces: list[Piece]) -> None:
        queue = self._queues[signature]
        level_depth = self.level_depth
        rows = 0
        for piece in pieces:
            size = piece.batch.size
            rows += size
            level_depth[piece.request.level] -= size
        queue.rows -= rows
        self.depth -= rows
        if not queue.levels:
            del self._queues[signature]
