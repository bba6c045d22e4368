"""Autoscaling a serving on Ray: the policy (:class:`Autoscaling`), the decision it makes from a reading of the
replicas' load (:func:`decide`, a pure function), and the thread of the deploying process that takes the
readings and scales as decided (:class:`Autoscaler`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Protocol

from ...errors import OptionError
from ...serving.options import finite_number
from ...serving.stats import ServerStats
from .operations import DeploymentStats, check_replicas

log = logging.getLogger("jitserve.cluster")


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    """When a serving on Ray adds and removes replicas, between ``min_replicas`` and ``max_replicas``.

    Up: once the rows waiting per replica stay at ``target_queue`` or above (default: the serving's
    ``batch_size``: a full batch waiting behind the one running) or, with ``target_wait_s``, the rows run
    lately waited longer than that on average, for ``upscale_delay_s``: to as many replicas as would bring
    the queue to the target (at least one more). Down: once the queue stays at most half the target and
    one replica fewer would have been less than ``busy_after_down`` busy (the hysteresis that keeps it from
    flapping), for ``downscale_delay_s``: to as few replicas as stay under that (at least one fewer). Read
    every ``period_s`` from the replicas' own counters."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue: float | None = None
    target_wait_s: float | None = None
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    busy_after_down: float = 0.7
    period_s: float = 0.25

    def __post_init__(self) -> None:
        check_replicas(self.min_replicas)
        check_replicas(self.max_replicas)
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise OptionError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                              f"{self.max_replicas}")
        for name in ("target_queue", "target_wait_s"):
            value = getattr(self, name)
            if value is not None and (not finite_number(value) or value <= 0):
                raise OptionError(f"{name} must be a finite number > 0 or None, got {value!r}")
        for name in ("upscale_delay_s", "downscale_delay_s", "period_s"):
            if not finite_number(getattr(self, name)) or getattr(self, name) < 0:
                raise OptionError(f"{name} must be a finite number of seconds >= 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Reading:
    """The replicas' load over one period of an autoscaler, from their counters at its two ends: when it
    ended (``at``, seconds of ``time.monotonic``), the replicas, the rows waiting per replica (``depth``), the
    mean wait of the rows run in it (``wait_s``), and the share of it each replica spent running batches, on
    average (``busy``)."""

    at: float
    replicas: int
    depth: float
    wait_s: float
    busy: float

    @classmethod
    def between(cls, then: float, before: ServerStats, now: float, after: ServerStats, replicas: int) -> Reading:
        """The reading of the period from ``then`` to ``now``, given the replicas' stats summed at each end."""
        rows = after.rows - before.rows
        wait = (after.queue_wait_s - before.queue_wait_s) / rows if rows > 0 else 0.0
        busy = max(after.execution_s - before.execution_s, 0.0) / max(now - then, 1e-9) / replicas
        return cls(now, replicas, after.queue_depth / replicas, wait, busy)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded: the replicas wanted (the reading's own number: no change) and why, and
    since when the load has been high or low (None: it is not), which the next decision goes on from."""

    replicas: int
    why: str = ""
    high_since: float | None = None
    low_since: float | None = None


def decide(policy: Autoscaling, target: float, reading: Reading, last: Decision | None = None) -> Decision:
    """The replicas ``policy`` wants after ``reading``, ``target`` being the rows waiting per replica it
    aims at and ``last`` the decision after the reading before (None: none since the last change). High
    load (at least ``target`` waiting, or waits over ``target_wait_s``) held for ``upscale_delay_s`` goes up,
    to as many as bring the queue to the target; low load held for ``downscale_delay_s`` goes down, to as
    few as stay under ``busy_after_down``; a change starts the next decision afresh. Pure: no clock, no
    cluster."""
    replicas, depth, wait, busy, now = reading.replicas, reading.depth, reading.wait_s, reading.busy, reading.at
    high = depth >= target or (policy.target_wait_s is not None and wait > policy.target_wait_s)
    low = depth <= target / 2 and busy * replicas / max(replicas - 1, 1) < policy.busy_after_down \
        and (policy.target_wait_s is None or wait <= policy.target_wait_s / 2)
    last = last or Decision(replicas)
    high_since = (now if last.high_since is None else last.high_since) if high else None
    low_since = (now if last.low_since is None else last.low_since) if low else None
    if high_since is not None and now - high_since >= policy.upscale_delay_s and replicas < policy.max_replicas:
        wanted = min(policy.max_replicas, max(replicas + 1, math.ceil(replicas * depth / target)))
        return Decision(wanted, f"{depth:.1f} rows waiting per replica, {wait * 1000:.0f} ms waits")
    if low_since is not None and now - low_since >= policy.downscale_delay_s and replicas > policy.min_replicas:
        wanted = max(policy.min_replicas, math.ceil(busy * replicas / policy.busy_after_down))
        return Decision(min(wanted, replicas - 1), f"idle: {depth:.1f} rows waiting, {busy:.0%} busy")
    return Decision(replicas, "", high_since, low_since)


class Scalable(Protocol):
    """What an autoscaler scales: a serving's replicas on Ray (``RayServing``)."""

    name: str

    @property
    def replicas(self) -> list[str]: ...

    def stats(self) -> DeploymentStats: ...

    def scale(self, replicas: int) -> None: ...


class Autoscaler:
    """Scales a deployment (``RayServing``) by its :class:`Autoscaling` on a thread of the deploying process:
    every ``period_s`` it reads the replicas' counters and scales as :func:`decide` says. ``events`` records
    each change: (seconds since start, replicas before, after, why)."""

    def __init__(self, handle: Scalable, policy: Autoscaling, batch_size: int) -> None:
        self.handle = handle
        self.policy = policy
        self.target = policy.target_queue if policy.target_queue is not None else float(batch_size)
        self.events: list[tuple[float, int, int, str]] = []
        self._started = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"jitserve-autoscale-{handle.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        last = None  # the time and summed stats the next reading starts from
        decision = None
        while not self._stopped.wait(self.policy.period_s):
            try:
                now, totals = time.monotonic(), ServerStats.total(self.handle.stats().replicas.values())  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - a replica restarting: look again next period
                continue
            replicas = len(self.handle.replicas)
            if last is None or replicas == 0:
                last = (now, totals)
                continue
            decision = decide(self.policy, self.target, Reading.between(*last, now, totals, replicas), decision)
            last = (now, totals)
            if decision.replicas != replicas:
                self._scale(replicas, decision.replicas, decision.why)
                last = None  # the next reading starts once the new replicas serve

    def _scale(self, replicas: int, wanted: int, why: str) -> None:
        """Decide (the event's time), then scale: returns once new replicas are warm."""
        log.info("autoscaling '%s': %d -> %d replicas (%s)", self.handle.name, replicas, wanted, why)
        self.events.append((time.monotonic() - self._started, replicas, wanted, why))
        self.handle.scale(wanted)
