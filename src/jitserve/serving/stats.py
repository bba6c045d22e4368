"""Typed statistics of a served thing: the counters every front keeps (:class:`FrontStats`) and each
engine's own (:class:`ServerStats` of a :class:`~jitserve.serving.server.Server`,
:class:`GenerationStats` of a :class:`~jitserve.serving.generation.GenerationServer`). Readers use
attributes; several replicas' stats add up with ``+`` (or :meth:`FrontStats.total`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

S = TypeVar("S", bound="FrontStats")


@dataclass
class FrontStats:
    """What every front counts since it started: requests taken, and rejected (queue full or too large),
    timed out or cancelled before they ran; compiles; failures; and what waits now (``queue_depth``)."""

    requests: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    compiles: int = 0
    errors: int = 0
    queue_depth: int = 0

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
                    merged[key] = merged.get(key, 0) + count
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
    and the rows they ran, padding included, executions per padded size, seconds waiting and executing, the
    runs bisecting failed batches took, and the batches running now (``in_flight``)."""

    batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    stopped: int = 0
    bisect_runs: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # padded size -> batches
    batch_execution_s: dict[int, float] = field(default_factory=dict)  # padded size -> seconds
    queue_wait_s: float = 0.0
    execution_s: float = 0.0
    in_flight: int = 0


@dataclass
class GenerationStats(FrontStats):
    """A generation server's own counters: outputs delivered, decode steps and prefills run, seconds to
    each request's first output and in steps, the most slots busy at once, and the slots (``slots``) and
    busy ones (``slots_busy``) now. With a paged KV cache also its blocks (``kv_blocks``) and those held
    now (``kv_blocks_used``), the prefix cache's blocks looked up and reused (``prefix_lookups``,
    ``prefix_hits``), the sequences preempted, and those still prefilling their prompts now."""

    outputs: int = 0
    steps: int = 0
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
