"""Which sequence runs in which row, and which blocks of a paged KV cache it holds, on plain data.

The paged engine's :class:`PagedScheduler` keeps the slot scheduler's rows
(``slots``: the most sequences one decode launch runs), queue and statistics,
and hands out blocks of a :class:`~.blocks.BlockPool` (vLLM's design, for a
loop that runs its plan a launch ahead of the host):

- each turn, every decoding sequence first gets the blocks its next launch
  writes; when none is left, the newest running sequence is preempted: its
  blocks go back, it waits at the head of the queue, and once its outputs in
  flight have arrived it is prefilled again from its prompt and those outputs,
  and goes on with the outputs it would have given;
- then prompts are prefilled in chunks of compiled lengths, at most ``chunk``
  tokens a turn, beside the decodes (a long prompt does not stall the running
  streams): those already under way first, then waiting ones admitted, first
  come first served, while a row and the blocks of their first chunk are free
  (and one block more for every decoding sequence, so that admitting does not
  force a preemption at once);
- a prompt's full blocks go into the prefix cache once computed, and a new
  prompt takes the cached blocks of its longest cached prefix and prefills only
  the rest (always its last token at least, whose logits give its first output).

A sequence holds the blocks of the positions it has written, never its whole
``max_length`` up front.
"""

from __future__ import annotations

import bisect
from typing import Any, Generic, NamedTuple

import numpy as np

from .blocks import BlockPool, block_keys
from .scheduler import Plan, R, Scheduler
from .spec import GREEDY, Generation, Sampling


class Chunk(NamedTuple, Generic[R]):
    """One prefill program's work: rows of ``tokens`` (compiled count x compiled ``length``, zeros after each
    row's ``counts`` tokens and in padding rows), each starting at ``starts`` of its sequence, whose block
    table is its row of ``tables``; ``slots``: where each row's first output goes (the number of slots: it
    goes nowhere, as the row's prompt is not done); ``samplings`` and ``steps`` (the step number of its
    output) pick it. ``requests``: those whose prefill it ends, which get their first output, in ``rows``."""

    length: int
    tokens: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    tables: np.ndarray
    slots: np.ndarray
    samplings: list[Sampling]
    steps: list[int]
    requests: list[R]
    rows: list[int]


class PagedStep(NamedTuple, Generic[R]):
    """A decode launch of the sequences done with their prompts, one row each (``requests`` in ``slots``, in
    slot order), padded to a compiled number of rows: per row its sequence's slot (``rows``; the number of
    slots in a padding row), the position its next token is written at (``cache_positions``, 0 in padding)
    and its block table (``tables``, as wide as ``max_length`` needs, zeros past its blocks and in padding);
    where some request samples, per row its ``samplings`` and ``positions`` (see
    :class:`~.scheduler.Step`; greedy and 0 in padding), else both None."""

    requests: list[R]
    slots: list[int]
    samplings: list[Sampling] | None
    positions: list[int] | None
    cache_positions: np.ndarray
    tables: np.ndarray
    rows: np.ndarray

    @property
    def output_rows(self) -> list[int]:
        """Each request's row of the launch's outputs: its row of the launch."""
        return list(range(len(self.requests)))


class PagedScheduler(Scheduler[R]):
    """The rows and blocks of one paged generation (see the module); ``preemptions`` counts the sequences
    preempted."""

    def __init__(self, generation: Generation) -> None:
        g = generation
        assert g.cache is not None
        super().__init__(g.slots, g.prefill_lengths, g.prefill_batches, g.steps_per_launch, g.max_queue)
        self.block_size = g.cache.block_size
        self.pool = BlockPool(g.cache.blocks(g.max_length), self.block_size)
        self.max_blocks = g.cache.table_blocks(g.max_length)  # a block table's width
        self.row_counts = g.cache.decode_rows(g.slots)  # a decode launch's compiled numbers of rows
        self.chunk = self.prefill_lengths[-1]  # prompt tokens prefilled per turn, at most
        self.prefix_caching = g.cache.prefix_caching
        self.prefilling: dict[R, tuple[np.ndarray, list[bytes]]] = {}  # admitted, not prefilled: sequence, keys
        self.admitted_order: dict[R, int] = {}  # running request -> when it was admitted (the newest is preempted)
        self.completed: list[tuple[int, bytes]] = []  # (block, key): full blocks of prompts this plan computes
        self.admissions = 0
        self.preemptions = 0

    @classmethod
    def of(cls, generation: Generation) -> PagedScheduler[Any]:
        return cls(generation)

    def release(self, requests: list[R]) -> None:
        for request in requests:
            if request in self.waiting:  # preempted, and ended by an eos among the outputs it had in flight
                self.waiting.remove(request)
            self._free(request)

    def _free(self, request: R) -> None:
        super()._free(request)
        if request.blocks:
            self.pool.release(request.blocks)
            request.blocks = []
        self.prefilling.pop(request, None)
        self.admitted_order.pop(request, None)

    def take_running(self) -> list[R]:
        """Every running request, its slot freed; the pool starts again empty (the cache is zeroed), its
        counters counting on."""
        requests = super().take_running()
        for request in requests:
            request.blocks = []
        self.prefilling.clear()
        self.admitted_order.clear()
        self.pool.clear()
        return requests

    def weights_changed(self) -> None:
        """New weights went live: the prefix cache's blocks hold keys and values the old weights computed, so
        none is shared again; no sequence holds a block now, and every block is free."""
        self.pool.clear()

    def plan(self, admit: bool = True) -> Plan[R]:
        decoding = [request for request in self.running.values() if request not in self.prefilling]
        for request in sorted(decoding, key=self.admitted_order.__getitem__):
            if request.slot >= 0:  # not preempted for an older one in this loop
                self._grow(request)
        chunks: list[tuple[R, np.ndarray, int, int]] = []  # (request, its sequence, start, count)
        budget = self.chunk
        for request in list(self.prefilling):
            if budget == 0 or not self._prefill(request, budget, chunks):
                break
            budget -= chunks[-1][3]
        admitted = []
        reserve = len(self.running) - len(self.prefilling)  # a block more for each decoding sequence
        # while new weights wait (not admit), a preempted sequence still resumes: its outputs so far are the
        # old weights', and so are those it has left
        while budget and self.free and self.waiting and (admit or self.waiting[0].dispatched) \
                and self._ready(self.waiting[0]):
            request = self.waiting[0]
            if not self._admit(request, budget, reserve, chunks):
                break
            admitted.append(self.waiting.popleft())
            budget -= chunks[-1][3]
        # blocks computed in this plan join the prefix cache once it is planned: a prompt of this plan taking
        # them could be prefilled by a program that runs before the one that writes them
        for block, key in self.completed:
            self.pool.register(block, key)
        self.completed.clear()
        return Plan(self._chunks(chunks), self._paged_step(), len(self.running), admitted)

    def _ready(self, request: R) -> bool:
        """A preempted request can be prefilled again once the outputs it had in flight have arrived."""
        return request.produced == request.dispatched

    def _reach(self, request: R, dispatched: int) -> int:
        """The positions its decode launch after ``dispatched`` outputs has written once it ran: those of the
        launch's tokens, which are its outputs so far but the last, up to the last output it needs."""
        return request.prompt.size + min(dispatched - 1 + self.steps_per_launch, request.needed - 1)

    def _grow(self, request: R) -> None:
        """The blocks ``request``'s next decode launch writes, preempting the newest running sequences (maybe
        ``request`` itself) while there are too few."""
        wanted = self.pool.blocks_for(self._reach(request, request.dispatched)) - len(request.blocks)
        while wanted > self.pool.available:
            victim = max(self.running.values(), key=self.admitted_order.__getitem__)
            self._preempt(victim)
            if victim is request:
                return
        if wanted > 0:
            request.blocks += self.pool.take(wanted)

    def _preempt(self, request: R) -> None:
        """``request`` gives back its row and blocks, and waits first in the queue to be prefilled again."""
        self._free(request)
        request.slot = -1
        request.computed = 0
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _admit(self, request: R, budget: int, reserve: int, chunks: list[tuple[R, np.ndarray, int, int]]) -> bool:
        """Give ``request`` a row, the cached blocks of its prefix and the blocks of its first chunk, if they
        leave ``reserve`` blocks free; plan that chunk."""
        history = [] if request.history is None else request.history
        sequence = np.concatenate([request.prompt, np.asarray(history, np.int32)]) if history else request.prompt
        keys = block_keys(sequence, self.block_size) if self.prefix_caching else []
        looked = keys[:(sequence.size - 1) // self.block_size]  # the last token is computed again, at least
        cached = self.pool.cached_prefix(looked)
        if cached < len(looked) and any(key == looked[cached] for _, key in self.completed):
            return False  # a prompt of this plan computes its next block (a twin, n > 1): wait, then share it
        shared = self.pool.share(looked)
        request.blocks = list(shared)
        request.computed = len(shared) * self.block_size
        request.history = history
        self.prefilling[request] = (sequence, keys)
        self.admitted_order[request] = self.admissions
        if not self._prefill(request, budget, chunks, reserve):
            self.prefilling.pop(request)
            self.admitted_order.pop(request)
            self.pool.release(shared)
            request.blocks = []
            return False
        self.pool.count_lookup(len(looked), len(shared))
        self.admissions += 1
        request.slot = self.free.pop(0)
        self.running[request.slot] = request
        self.sampling += request.sampling.kind > 0
        return True

    def _prefill(self, request: R, budget: int, chunks: list[tuple[R, np.ndarray, int, int]],
                 reserve: int = 0) -> bool:
        """Plan ``request``'s next chunk of at most ``budget`` tokens if its blocks (and, when it ends the
        prompt, those of the first decode launch after it) leave ``reserve`` free; full blocks it completes
        join the prefix cache."""
        sequence, keys = self.prefilling[request]
        start = request.computed
        count = min(sequence.size - start, budget)
        final = start + count == sequence.size
        written = start + count
        if final:  # it decodes in this plan's launch too, once this chunk's output is dispatched
            written = max(written, self._reach(request, request.dispatched + 1))
        wanted = self.pool.blocks_for(written) - len(request.blocks)
        if wanted + reserve > self.pool.available:
            return False
        request.blocks += self.pool.take(max(wanted, 0))
        request.computed = start + count
        for index in range(start // self.block_size, min(request.computed // self.block_size, len(keys))):
            self.completed.append((request.blocks[index], keys[index]))
        chunks.append((request, sequence, start, count))
        if final:
            del self.prefilling[request]
        return True

    def _chunks(self, planned: list[tuple[R, np.ndarray, int, int]]) -> list[Chunk[R]]:
        """The planned chunks grouped by the compiled length they pad to, in programs of a compiled number of
        rows; a chunk that ends its prompt gives the request its first output."""
        groups: dict[int, list[tuple[R, np.ndarray, int, int]]] = {}
        for item in planned:
            length = self.prefill_lengths[bisect.bisect_left(self.prefill_lengths, item[3])]
            groups.setdefault(length, []).append(item)
        chunks = []
        widest = self.prefill_batches[-1]
        for length, group in groups.items():
            for first in range(0, len(group), widest):
                chunks.append(self._chunk(length, group[first:first + widest]))
        return chunks

    def _chunk(self, length: int, items: list[tuple[R, np.ndarray, int, int]]) -> Chunk[R]:
        count = self.prefill_batches[bisect.bisect_left(self.prefill_batches, len(items))]
        tokens = np.zeros((count, length), np.int32)
        starts = np.zeros(count, np.int32)
        counts = np.ones(count, np.int32)
        tables = np.zeros((count, self.max_blocks), np.int32)
        slots = np.full(count, self.slots, np.int32)
        samplings, steps = [GREEDY] * count, [0] * count
        requests, rows = [], []
        for row, (request, sequence, start, size) in enumerate(items):
            tokens[row, :size] = sequence[start:start + size]
            starts[row], counts[row] = start, size
            tables[row, :len(request.blocks)] = request.blocks
            if start + size == sequence.size:  # its prompt is done: its first output (or the next, resumed)
                slots[row] = request.slot
                samplings[row], steps[row] = request.sampling, request.dispatched
                requests.append(request)
                rows.append(row)
        self._dispatched(requests, 1)
        return Chunk(length, tokens, starts, counts, tables, slots, samplings, steps, requests, rows)

    def _paged_step(self) -> PagedStep[R] | None:
        """The decode launch of every sequence done with its prompt, if any, in as few compiled rows as hold
        them."""
        decoding = {slot: r for slot, r in self.running.items() if r not in self.prefilling}
        if not decoding:
            return None
        slots = sorted(decoding)
        requests = [decoding[slot] for slot in slots]
        count = self.row_counts[bisect.bisect_left(self.row_counts, len(requests))]
        tables = np.zeros((count, self.max_blocks), np.int32)
        positions = np.zeros(count, np.int32)
        rows = np.full(count, self.slots, np.int32)
        for row, request in enumerate(requests):
            tables[row, :len(request.blocks)] = request.blocks
            positions[row] = request.prompt.size + request.dispatched - 1
            rows[row] = request.slot
        samplings, steps = None, None
        if any(r.sampling.kind for r in requests):
            padding = count - len(requests)
            samplings = [*(r.sampling for r in requests), *[GREEDY] * padding]
            steps = [*(r.dispatched for r in requests), *[0] * padding]
        self._dispatched(requests, self.steps_per_launch)
        return PagedStep(requests, slots, samplings, steps, positions, tables, rows)

    def counters(self) -> dict[str, Any]:
        """The cache's readings for the statistics."""
        pool = self.pool
        return {"kv_blocks": pool.usable, "kv_blocks_used": pool.used, "prefix_lookups": pool.lookups,
                "prefix_hits": pool.hits, "preemptions": self.preemptions,
                "slots_prefilling": len(self.prefilling)}
