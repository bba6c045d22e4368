"""Typed statistics of a served thing: the counters every front keeps (:class:`FrontStats`) and each
engine's own (:class:`ServerStats` of a :class:`~jitserve.serving.server.Server`,
:class:`GenerationStats` of a :class:`~jitserve.serving.generation.GenerationServer`). Readers use
attributes; several replicas' stats add up with ``+`` (or :meth:`FrontStats.total`).

Time is counted as Triton counts it (its statistics extension): per request that completed, its wait in
the queue and its share of each :class:`Phases` (preparing the inputs, the compiled program, the outputs)
of every execution that ran it; per execution, the phases by the size it ran at
(:meth:`FrontStats.executions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

S = TypeVar("S", bound="FrontStats")


@dataclass(frozen=True)
class Phases:
    """Seconds spent in the three phases of running a batch (or a generation's launch), as Triton splits
    an execution: ``input_s`` preparing the inputs (rows stacked and padded into the batch, copied to the
    device where the engine copies them itself), ``infer_s`` the compiled program, ``output_s`` the outputs
    copied to the host and cut to the real rows (handing them to their callers is not counted: a request's
    phases end before it is answered). Summed with ``+``."""

    input_s: float = 0.0
    infer_s: float = 0.0
    output_s: float = 0.0

    def __add__(self, other: Phases) -> Phases:
        return Phases(self.input_s + other.input_s, self.infer_s + other.infer_s, self.output_s + other.output_s)

    def times(self, count: int) -> Phases:
        """These phases counted ``count`` times (one execution's, for each of the requests it ran)."""
        return Phases(self.input_s * count, self.infer_s * count, self.output_s * count)

    @property
    def total_s(self) -> float:
        return self.input_s + self.infer_s + self.output_s


NO_TIME = Phases()


@dataclass
class FrontStats:
    """What every front counts since it started: requests taken, and rejected (queue full or too large),
    timed out or cancelled before they ran; compiles; failures; and what waits now (``queue_depth``).

    Of the requests that completed (``completed``: every row, or every output, given; a failed or
    cancelled one is not among them): their seconds waiting in the queue before their first execution
    (``completed_queue_s``) and their share of the executions that ran them (``completed_phases``: each
    request counts in full each execution it was part of, as Triton counts a batch's time for each of
    its requests)."""

    requests: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    compiles: int = 0
    errors: int = 0
    queue_depth: int = 0
    completed: int = 0
    completed_queue_s: float = 0.0
    completed_phases: Phases = NO_TIME

    @property
    def inferences(self) -> int:
        """Triton's ``inference_count``: what the completed requests inferred (rows of a serving)."""
        return self.completed

    def executions(self) -> dict[int, tuple[int, Phases]]:
        """Triton's batch statistics: executions by the batch size they ran at -> (how many, their summed
        phases)."""
        return {}

    def snapshot(self: S, **now: Any) -> S:
        """A copy that later counting does not change, with the readings of ``now`` set."""
        copied = {f.name: dict(value) for f in dataclasses.fields(self)
                  if isinstance(value := getattr(self, f.name), dict)}
        return dataclasses.replace(self, **{**copied, **now})

    def __add__(self: S, other: S) -> S:
        """Both counts summed, field by field (counts per batch size too)."""
        summed: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                merged = dict(mine)
                for key, count in theirs.items():
                    merged[key] = merged[key] + count if key in merged else count
                summed[f.name] = merged
            else:
                summed[f.name] = mine + theirs
        return dataclasses.replace(self, **summed)

    @classmethod
    def total(cls: type[S], many: Iterable[S]) -> S:
        """Several replicas' stats summed, of their own kind (zero counts of ``cls`` when there are none)."""
        summed: S | None = None
        for one in many:
            summed = one if summed is None else summed + one
        return cls() if summed is None else summed


@dataclass
class ServerStats(FrontStats):
    """A :class:`~jitserve.serving.server.Server`'s own counters: requests stopped before they ran; batches
    and the rows they ran, padding included, executions and their phases per padded size, seconds every
    piece of a request waited and batches executed, the runs bisecting failed batches took, the batches
    running now (``in_flight``), and the rows of the completed requests (``completed_rows``)."""

    batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    stopped: int = 0
    bisect_runs: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # padded size -> batches
    batch_phases: dict[int, Phases] = field(default_factory=dict)  # padded size -> their phases
    queue_wait_s: float = 0.0
    execution_s: float = 0.0
    in_flight: int = 0
    completed_rows: int = 0

    @property
    def inferences(self) -> int:
        return self.completed_rows

    def executions(self) -> dict[int, tuple[int, Phases]]:
        """Batches by the padded size they ran at (the size of the compiled program)."""
        return {size: (count, self.batch_phases.get(size, NO_TIME)) for size, count in self.batch_sizes.items()}


@dataclass
class GenerationStats(FrontStats):
    """A generation server's own counters: outputs delivered, decode steps, the launches that ran them
    (``steps_per_launch`` steps each) and their phases, prefills run, seconds to each request's first
    output and in steps, the most slots busy at once, and the slots (``slots``) and busy ones
    (``slots_busy``) now. With a paged KV cache also its blocks (``kv_blocks``) and those held now
    (``kv_blocks_used``), the prefix cache's blocks looked up and reused (``prefix_lookups``,
    ``prefix_hits``), the sequences preempted, and those still prefilling their prompts now."""

    outputs: int = 0
    steps: int = 0
    launches: int = 0
    launch_phases: Phases = NO_TIME
    prefills: int = 0
    first_output_s: float = 0.0
    step_s: float = 0.0
    max_slots_busy: int = 0
    slots: int = 0
    slots_busy: int = 0
    kv_blocks: int = 0
    kv_blocks_used: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    slots_prefilling: int = 0

    def executions(self) -> dict[int, tuple[int, Phases]]:
        """Decode launches, each of every slot (the size of the compiled step)."""
        return {self.slots: (self.launches, self.launch_phases)} if self.launches else {}
