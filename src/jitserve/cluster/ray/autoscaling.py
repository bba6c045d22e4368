"""Autoscaling a serving on Ray: the policy (:class:`Autoscaling`) and the thread of the deploying process
that reads the replicas' counters and scales by it (:class:`Autoscaler`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any, Protocol

from ...errors import OptionError
from ...serving.options import finite_number
from .operations import check_replicas, total

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


class Scalable(Protocol):
    """What an autoscaler scales: a serving's replicas on Ray (``RayServing``)."""

    name: str

    @property
    def replicas(self) -> list[str]: ...

    def stats(self) -> dict[str, Any]: ...

    def scale(self, replicas: int) -> None: ...


class Autoscaler:
    """Scales a :class:`RayServing` by its :class:`Autoscaling` on a thread of the deploying process;
    ``events`` records each decision: (seconds since start, replicas before, after, why)."""

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
        policy = self.policy
        last = None
        high_since = low_since = None
        while not self._stopped.wait(policy.period_s):
            try:
                now, totals = time.monotonic(), total(self.handle.stats()["replicas"].values())
            except Exception:  # noqa: BLE001 - a replica restarting: look again next period
                continue
            replicas = len(self.handle.replicas)
            if last is None or replicas == 0:
                last = (now, totals)
                continue
            (then, before), last = last, (now, totals)
            rows = totals["rows"] - before["rows"]
            wait = (totals["queue_wait_s"] - before["queue_wait_s"]) / rows if rows > 0 else 0.0
            busy = max(totals["execution_s"] - before["execution_s"], 0.0) / max(now - then, 1e-9) / replicas
            depth = totals["queue_depth"] / replicas
            high = depth >= self.target or (policy.target_wait_s is not None and wait > policy.target_wait_s)
            low = depth <= self.target / 2 and busy * replicas / max(replicas - 1, 1) < policy.busy_after_down \
                and (policy.target_wait_s is None or wait <= policy.target_wait_s / 2)
            high_since = (high_since or now) if high else None
            low_since = (low_since or now) if low else None
            if high_since is not None and now - high_since >= policy.upscale_delay_s \
                    and replicas < policy.max_replicas:
                wanted = min(policy.max_replicas, max(replicas + 1, math.ceil(replicas * depth / self.target)))
                self._scale(replicas, wanted, f"{depth:.1f} rows waiting per replica, {wait * 1000:.0f} ms waits")
                high_since = last = None
            elif low_since is not None and now - low_since >= policy.downscale_delay_s \
                    and replicas > policy.min_replicas:
                wanted = max(policy.min_replicas, math.ceil(busy * replicas / policy.busy_after_down))
                self._scale(replicas, min(wanted, replicas - 1), f"idle: {depth:.1f} rows waiting, {busy:.0%} busy")
                low_since = last = None

    def _scale(self, replicas: int, wanted: int, why: str) -> None:
        """Decide (the event's time), then scale: returns once new replicas are warm."""
        log.info("autoscaling '%s': %d -> %d replicas (%s)", self.handle.name, replicas, wanted, why)
        self.events.append((time.monotonic() - self._started, replicas, wanted, why))
        self.handle.scale(wanted)
