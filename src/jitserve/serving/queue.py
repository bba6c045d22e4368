"""The whole batching policy in one place: request handles, the queues per batch signature, and what runs next.

A :class:`Request` is one caller's rows in flight; local servers, the cluster
coalescer and the network fronts all hand out and wait on this one type. A
request's rows are queued as :class:`Piece` s of at most ``batch_size`` rows on
the queue of their batch signature (key, structure, per-row shapes and
dtypes). :class:`Queues` decides which queue is ready (full, its oldest row
has waited ``batch_timeout``, or the server is draining; oldest first), takes
rows from it (``BatchPolicy.rows_to_take``, splitting a piece that does not
fit), pads them to a compiled size (``BatchPolicy.padded_size``), and takes
requests back off the queues (timeouts, cancelled callers, a stop without
drain). It holds no lock of its own: the server calls it under its condition.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..batch import Batch

Signature = tuple[Any, ...]


class Request:
    """One caller's rows in flight. A sync caller waits on ``done`` (a held lock released when the request
    finishes); an asyncio caller awaits ``future``, resolved on its own ``loop``. ``parts`` collects
    ``(row offset, outputs)`` as batches finish; ``error`` is set instead when the request failed."""

    __slots__ = ("rows", "rows_left", "parts", "error", "started", "done", "loop", "future")

    def __init__(self, rows: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.rows = rows
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

    def fail(self, error: BaseException) -> bool:
        """Finish the request with ``error`` unless it already failed; True if this call finished it."""
        if self.error is not None:
            return False
        self.error = error
        self.rows_left = 0
        return True


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
    ``pad``), run when full or when the oldest row has waited ``batch_timeout`` seconds; at most
    ``max_queue`` rows wait (None: no bound)."""

    batch_size: int
    batch_sizes: Sequence[int]
    batch_timeout: float
    max_queue: int | None = None
    pad: bool = True

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


class Queues:
    """The queues of pieces per batch signature, and the rows queued in each and in all."""

    __slots__ = ("policy", "_queues", "_rows", "depth")

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queues: dict[Signature, deque[Piece]] = {}
        self._rows: dict[Signature, int] = {}
        self.depth = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    def add(self, request: Request, parts: Sequence[Batch], signature: Signature, now: float) -> bool:
        """Queue a request's parts (consecutive row ranges). True when a waiting worker must look now:
        the queue was empty (a new deadline) or now holds a full batch."""
        queue = self._queues.get(signature)
        if queue is None:
            queue = self._queues[signature] = deque()
        queued = self._rows.get(signature, 0)
        offset = 0
        for part in parts:
            queue.append(Piece(request, offset, part, now))
            offset += part.size
        self._rows[signature] = queued + offset
        self.depth += offset
        return queued == 0 or queued + offset >= self.policy.batch_size

    def ready(self, now: float, draining: bool) -> tuple[Signature | None, float | None]:
        """The queue to run now (full, due, or draining; the oldest head first), else how long to wait."""
        policy = self.policy
        best = oldest = wait = None
        for signature, queue in self._queues.items():
            head = queue[0].enqueued
            due = head + policy.batch_timeout
            if draining or due <= now or self._rows[signature] >= policy.batch_size:
                if oldest is None or head < oldest:
                    best, oldest = signature, head
            elif wait is None or due - now < wait:
                wait = due - now
        return best, wait

    def take(self, signature: Signature) -> tuple[list[Piece], Batch]:
        """Rows from the front of one queue (``rows_to_take``, splitting the last piece if needed), their
        requests marked started, joined into one batch padded to its compiled size."""
        queue = self._queues[signature]
        space = self.policy.rows_to_take(self._rows[signature])
        taken: list[Piece] = []
        while queue and space:
            piece = queue[0]
            if piece.batch.size > space:
                head, tail = piece.batch.split(space)
                queue[0] = Piece(piece.request, piece.offset + space, tail, piece.enqueued)
                piece = Piece(piece.request, piece.offset, head, piece.enqueued)
            else:
                queue.popleft()
            piece.request.started = True
            taken.append(piece)
            space -= piece.batch.size
        rows = sum([piece.batch.size for piece in taken])
        self._forget(signature, rows)
        merged = Batch.join([piece.batch for piece in taken])
        return taken, merged.pad_to(self.policy.padded_size(rows))

    def withdraw(self, request: Request) -> None:
        """Take every queued piece of ``request`` off the queues."""
        self._remove(lambda piece: piece.request is request)

    def withdraw_unstarted(self) -> list[Request]:
        """Take every request none of whose rows started off the queues (a stop without drain); the
        pieces of started requests stay, so that no request runs only in part."""
        removed = self._remove(lambda piece: not piece.request.started)
        return list({id(piece.request): piece.request for piece in removed}.values())

    def _remove(self, chosen: Callable[[Piece], bool]) -> list[Piece]:
        """Take the ``chosen`` pieces off every queue; returns them."""
        removed = []
        for signature, queue in list(self._queues.items()):
            pieces = [piece for piece in queue if chosen(piece)]
            for piece in pieces:
                queue.remove(piece)
            self._forget(signature, sum([piece.batch.size for piece in pieces]))
            removed += pieces
        return removed

    def _forget(self, signature: Signature, rows: int) -> None:
        self._rows[signature] -= rows
        self.depth -= rows
        if not self._queues[signature]:
            del self._queues[signature], self._rows[signature]
