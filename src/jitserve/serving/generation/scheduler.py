"""Which request runs in which slot, worked out on plain data: no jax, no device, no thread.

A :class:`Scheduler` keeps three things in the open: the free slots, the queue
of waiting requests and the map of running ones (slot -> request). Each turn of
a server's loop asks it for a :class:`Plan`: the waiting prompts it admits into
free slots (lowest first, in arrival order), grouped into prefills by compiled
prompt length and padded to a compiled number of prompts, then one decode
launch of every slot when any runs. A slot is free again once the last output
its request needs is in a plan (the outputs are on their way), when
:meth:`Scheduler.update` sees it end with a launch's outputs (at ``eos`` or a
stop id; the one place that decides an end and why), when it fails, or at the
next plan once its caller cancelled; a request that waited too long leaves the
queue. The server holds its lock around every call and runs what the plan says
on its programs: this is vLLM's ``schedule`` / ``update_from_output`` /
model-runner seam, where a paged KV cache plugs in (blocks handed out beside
slots).
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from .spec import GREEDY, Generation, Sampling


class SlotRequest:
    """One request as the scheduler sees it: its prompt and sampling, the outputs it ``needed`` unless
    ``eos`` ends it first (``max_steps``, or as many as fit ``max_length``; the first always), how many are
    ``dispatched`` (in a plan: being computed or computed, ahead of ``produced`` by a launch at most) and
    ``produced`` (delivered), whether it ``ended`` (it got its end or an error: later outputs computed for
    it are dropped) and why (``finish_reason``: ``"stop"`` or ``"length"``, None after an error) or was
    ``cancelled``, and its ``slot`` once admitted (-1 before). In a paged cache
    (:mod:`~.paged_scheduler`) also the ``blocks`` it holds, how many positions of its sequence are
    ``computed`` (their keys and values written, or on their way), and its outputs so far (``history``,
    from which its state is computed again after a preemption)."""

    __slots__ = ("prompt", "sampling", "needed", "dispatched", "produced", "ended", "finish_reason", "cancelled",
                 "slot", "blocks", "computed", "history")

    def __init__(self, prompt: np.ndarray, max_steps: int, sampling: Sampling, max_length: int) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.needed = max(1, min(max_steps, max_length - prompt.size))
        self.dispatched = 0
        self.produced = 0
        self.ended = False
        self.finish_reason: str | None = None
        self.cancelled = False
        self.slot = -1
        self.blocks: list[int] = []
        self.computed = 0
        self.history: list[int] | None = None


R = TypeVar("R", bound=SlotRequest)


class Prefill(NamedTuple, Generic[R]):
    """Prompts prefilled together at one compiled ``length``: ``requests``, in rows 0.. of its outputs, and
    ``padded``: them, then the first again up to a compiled number of prompts (its row written into its own
    slot again, alike)."""

    length: int
    requests: list[R]
    padded: list[R]

    @property
    def rows(self) -> list[int]:
        """Each request's row of the prefill's outputs."""
        return list(range(len(self.requests)))


class Step(NamedTuple, Generic[R]):
    """A launch of decode steps of every slot: ``requests`` running in ``slots`` (their rows of its outputs),
    in slot order; where some request samples, per slot its request's ``samplings`` (greedy where idle) and
    ``positions``: the outputs of its request dispatched before this launch, the number of its first step in
    it (0 where idle); both None for a greedy launch."""

    requests: list[R]
    slots: list[int]
    samplings: list[Sampling] | None
    positions: list[int] | None

    @property
    def output_rows(self) -> list[int]:
        """Each request's row of the launch's outputs: its slot."""
        return self.slots


class Plan(NamedTuple, Generic[R]):
    """What one turn of a server's loop launches: the prefills of the prompts it admitted, then a decode
    launch (None when no slot runs); ``busy``: the slots running once the prompts were admitted;
    ``admitted``: the requests that took a slot in this plan."""

    prefills: list[Any]
    step: Any
    busy: int
    admitted: list[R]

    @property
    def requests(self) -> list[R]:
        """Every request the plan computes outputs for."""
        return [*(r for prefill in self.prefills for r in prefill.requests), *(self.step.requests if self.step else [])]


class Scheduler(Generic[R]):
    """The slots of one generation and the requests that wait for them or run in them (see the module)."""

    def __init__(self, slots: int, prefill_lengths: list[int], prefill_batches: list[int], steps_per_launch: int,
                 max_queue: int | None) -> None:
        self.slots = slots
        self.prefill_lengths = prefill_lengths  # compiled prompt lengths, ascending
        self.prefill_batches = prefill_batches  # compiled numbers of prompts prefilled together, ascending
        self.steps_per_launch = steps_per_launch
        self.max_queue = max_queue
        self.free: list[int] = list(range(slots))  # ascending: a prompt takes the lowest
        self.waiting: collections.deque[R] = collections.deque()
        self.running: dict[int, R] = {}
        self.sampling = 0  # running requests not greedy: a launch samples (or scores) while any runs

    @classmethod
    def of(cls, generation: Generation) -> Scheduler[Any]:
        """The scheduler of ``generation``'s slots."""
        g = generation
        return cls(g.slots, g.prefill_lengths, g.prefill_batches, g.steps_per_launch, g.max_queue)

    def counters(self) -> dict[str, Any]:
        """The engine's own readings for the statistics (a paged cache's; none here)."""
        return {}

    @property
    def full(self) -> bool:
        """The queue holds ``max_queue`` requests: a new one is refused."""
        return self.max_queue is not None and len(self.waiting) >= self.max_queue

    def submit(self, request: R) -> None:
        self.waiting.append(request)

    def cancel(self, request: R) -> bool:
        """Its caller stopped reading: a waiting request leaves the queue (True), a running one frees its slot
        at the next plan (False, as for one that had ended or was cancelled already)."""
        if request.ended or request.cancelled:
            return False
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
            return True
        return False

    def expire(self, request: R) -> bool:
        """A request whose caller gave up waiting for a slot leaves the queue, cancelled; False if it is
        admitted, cancelled or gone already."""
        if request.slot >= 0 or request.cancelled or request not in self.waiting:
            return False
        self.waiting.remove(request)
        request.cancelled = True
        return True

    def release_cancelled(self) -> int:
        """Free the slots whose requests were cancelled (or ended) while running; how many."""
        gone = [request for request in self.running.values() if request.ended or request.cancelled]
        if gone:
            self.release(gone)
        return len(gone)

    def update(self, requests: list[R], rows: list[int], outputs: np.ndarray,
               eos: np.ndarray | None) -> tuple[list[int], list[R]]:
        """A launch's ``outputs`` (steps, rows, ...) given to ``requests``, each from row ``rows[i]``, in step
        order, as vLLM's ``update_from_output`` and ``check_stop``: how many each takes, and the requests
        they end, whose slots are freed. An output ends its request with ``finish_reason`` ``"stop"`` when it
        is one of ``eos`` (unless the request ignores them) or of its stop ids, else ``"length"`` when it is
        the last output needed; a request that ended or was cancelled takes none (what was computed for it
        meanwhile is dropped)."""
        steps, count = outputs.shape[:2]
        # which outputs are an eos, at once: comparing row by row costs more than the rest of the update
        at_eos = None if eos is None else (outputs[:, :, None] == eos).reshape(
            steps, count, len(eos), -1).all(axis=3).any(axis=2)
        taken, finished = [], []
        for request, row in zip(requests, rows):
            took = 0
            stops = request.sampling.stop_token_ids
            ends_at_eos = at_eos is not None and not request.sampling.ignore_eos
            while took < steps and not (request.ended or request.cancelled):
                output = outputs[took, row]
                took += 1
                request.produced += 1
                if request.history is not None:  # a paged cache's request: its state may be computed again from it
                    request.history.append(int(output))
                if (ends_at_eos and at_eos[took - 1, row]) or (stops and int(output) in stops):  # type: ignore[index]
                    request.finish_reason = "stop"
                elif request.produced >= request.needed:
                    request.finish_reason = "length"
                else:
                    continue
                request.ended = True
                finished.append(request)
            taken.append(took)
        self.release(finished)
        return taken, finished

    def release(self, requests: list[R]) -> None:
        """Free the slots of ``requests`` that still hold one: they ended."""
        for request in requests:
            self._free(request)

    def _free(self, request: R) -> None:
        if self.running.get(request.slot) is request:
            del self.running[request.slot]
            bisect.insort(self.free, request.slot)
            self.sampling -= request.sampling.kind > 0

    @property
    def between_weights(self) -> bool:
        """No request runs or waits to resume (a preempted one): new weights may go live."""
        return not self.running and not any(request.dispatched for request in self.waiting)

    def weights_changed(self) -> None:
        """New weights went live (no request runs): what the engine kept of the old ones is gone (the slot
        engine keeps nothing past a request)."""

    def take_waiting(self) -> list[R]:
        """Every waiting request, off the queue."""
        requests = list(self.waiting)
        self.waiting.clear()
        return requests

    def take_running(self) -> list[R]:
        """Every running request, its slot freed (they are to end with an error)."""
        requests = list(self.running.values())
        self.running.clear()
        self.free = list(range(self.slots))
        self.sampling = 0
        return requests

    def plan(self, admit: bool = True) -> Plan[R]:
        """The next launch: waiting requests admitted into free slots (none unless ``admit``: new weights wait
        for the slots to run empty), their prompts grouped into prefills, then a decode launch of every slot
        if any runs. What the plan dispatches counts as dispatched at once, and a request whose last needed
        output is in it gives up its slot: the next plan may admit a prompt there."""
        count = min(len(self.free), len(self.waiting)) if admit else 0
        admitted = [self.waiting.popleft() for _ in range(count)]
        for request, slot in zip(admitted, self.free):
            request.slot = slot
            self.running[slot] = request
            self.sampling += request.sampling.kind > 0
        del self.free[:count]
        busy = len(self.running)
        prefills = []
        if admitted:
            prefills = self._prefills(admitted)
            self._dispatched(admitted, 1)
        return Plan(prefills, self._step(), busy, admitted)

    def _prefills(self, admitted: list[R]) -> list[Prefill[R]]:
        """``admitted`` grouped by the compiled length their prompts pad to, each group padded to a compiled
        number of prompts."""
        groups: dict[int, list[R]] = {}
        for request in admitted:
            length = self.prefill_lengths[bisect.bisect_left(self.prefill_lengths, request.prompt.size)]
            groups.setdefault(length, []).append(request)
        prefills = []
        for length, group in groups.items():
            count = self.prefill_batches[bisect.bisect_left(self.prefill_batches, len(group))]
            prefills.append(Prefill(length, group, group + [group[0]] * (count - len(group))))
        return prefills

    def _step(self) -> Step[R] | None:
        """The decode launch of every slot, if any runs."""
        if not self.running:
            return None
        slots = sorted(self.running)
        requests = [self.running[slot] for slot in slots]
        samplings, positions = self._options(self.running) if self.sampling else (None, None)
        self._dispatched(requests, self.steps_per_launch)
        return Step(requests, slots, samplings, positions)

    def _options(self, stepped: dict[int, R]) -> tuple[list[Sampling], list[int]]:
        """Per slot, the sampling of the request ``stepped`` runs there and the number of its launch's first
        step (its outputs dispatched so far); greedy at step 0 where none runs."""
        every = [stepped.get(slot) for slot in range(self.slots)]
        return ([GREEDY if request is None else request.sampling for request in every],
                [0 if request is None else request.dispatched for request in every])

    def _dispatched(self, requests: list[R], outputs: int) -> None:
        """``outputs`` more outputs of each of ``requests`` are in a plan; a request whose last needed one is
        among them gives up its slot."""
        for request in requests:
            request.dispatched += outputs
            if request.dispatched >= request.needed:
                self._free(request)
