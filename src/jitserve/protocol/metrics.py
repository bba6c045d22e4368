"""Prometheus metrics of the network front, fed by the servers' batch listeners.

- requests by model, protocol and status, and their durations by model and
  version (from arrival to the last output, answered or failed);
- the process: CPU, memory, open descriptors, garbage collection;
- read from each server's stats at scrape time: queue depth and compiles; a
  generation server's slots and busy slots; for a cluster serving, each
  replica's requests, batches, rows, errors and queue depth;
- from every executed batch: its size, padding rows, execution time, and the
  queue wait of each request that started in it; from a generation server,
  each time to first output and each step.

Every family of a model is labelled ``model`` and ``version`` (the version
``1`` for a model served in one version). The per-request and per-batch
families are fed without a lock (each thread its own tally, added up when
scraped), so that they cost the hot path a few additions.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..serving.front import Front
from ..serving.partition import BatchReport
from ..serving.stats import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_REPLICA_COUNTERS = {"requests": "Requests a cluster replica took", "batches": "Batches a cluster replica ran",
                     "rows": "Rows a cluster replica ran", "errors": "Failed batches on a cluster replica"}
_GENERATION_GAUGES = {"slots_busy": "Slots of a generation server decoding a request",
                      "slots": "Slots of a generation server",
                      "slots_prefilling": "Slots of a generation server still prefilling their prompts",
                      "kv_blocks": "Blocks of a generation server's paged KV cache",
                      "kv_blocks_used": "Blocks of a generation server's paged KV cache held by sequences"}
_GENERATION_COUNTERS = {"prefix_lookups": "Prompt blocks looked up in a generation server's prefix cache",
                        "prefix_hits": "Prompt blocks a generation server reused from its prefix cache",
                        "preemptions": "Sequences a generation server preempted for lack of KV cache blocks"}
_GENERATION_TIMES = {"first_output": "Time from a generation request's arrival to its first output",
                     "step": "Time of one decode step of every busy slot"}
_TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


LABELS = ["model", "version"]  # on every family of a model; requests add protocol and status


class _Family:
    """A counter or histogram family that requests and batches feed without a lock: each label set's child
    keeps one tally per thread that writes to it (so no thread's addition is lost to another's), and a
    scrape adds them up. prometheus_client's own take a lock and make Python calls per value, on every
    request's path; these are a dict lookup and two additions."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], make: Callable[[], Any]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labels)
        self._make = make
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children.setdefault(values, self._make())
        return child


class _CounterChild:
    __slots__ = ("by_thread",)

    def __init__(self) -> None:
        self.by_thread: dict[int, float] = {}

    def inc(self, amount: float = 1) -> None:
        by_thread, ident = self.by_thread, threading.get_ident()
        by_thread[ident] = by_thread.get(ident, 0) + amount

    def value(self) -> float:
        return sum(list(self.by_thread.values()))


class _HistogramChild:
    """Counts per bucket (the last for +Inf) and, after them, the sum of the values, per thread."""

    __slots__ = ("bounds", "by_thread")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.by_thread: dict[int, list[float]] = {}

    def observe(self, value: float) -> None:
        ident = threading.get_ident()
        mine = self.by_thread.get(ident)
        if mine is None:
            mine = self.by_thread[ident] = [0] * (len(self.bounds) + 1) + [0.0]
        mine[bisect.bisect_left(self.bounds, value)] += 1  # its bucket: the first whose bound it does not exceed
        mine[-1] += value

    def read(self) -> list[float]:
        return [sum(column) for column in zip(*list(self.by_thread.values()))] or [0] * (len(self.bounds) + 2)


class Counter(_Family):
    def __init__(self, name: str, documentation: str, labels: Sequence[str], registry: CollectorRegistry) -> None:
        super().__init__(name, documentation, labels, _CounterChild)
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            family.add_metric(values, child.value())
        yield family


class Histogram(_Family):
    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = tuple(float(bound) for bound in buckets)
        super().__init__(name, documentation, labels, lambda: _HistogramChild(bounds))
        self.les = [floatToGoString(bound) for bound in (*bounds, math.inf)]
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            *counts, total = child.read()
            family.add_metric(values, list(zip(self.les, itertools.accumulate(counts))), total)
        yield family


class _ServerStats:
    """Reads queue depth and compile counts from the servers when scraped."""

    def __init__(self, servers: Mapping[tuple[str, str], Front]) -> None:
        self.servers = servers

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("jitserve_queue_depth", "Rows waiting in the queue", labels=LABELS)
        compiles = GaugeMetricFamily("jitserve_compiles", "Executables compiled so far", labels=LABELS)
        replica = {key: CounterMetricFamily(f"jitserve_replica_{key}", help, labels=[*LABELS, "replica"])
                   for key, help in _REPLICA_COUNTERS.items()}
        replica_depth = GaugeMetricFamily("jitserve_replica_queue_depth", "Rows waiting on a cluster replica",
                                          labels=[*LABELS, "replica"])
        slots: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            **{key: GaugeMetricFamily(f"jitserve_generation_{key}", help, labels=LABELS)
               for key, help in _GENERATION_GAUGES.items()},
            **{key: CounterMetricFamily(f"jitserve_generation_{key}", help, labels=LABELS)
               for key, help in _GENERATION_COUNTERS.items()}}
        clustered = False
        for labels, server in list(self.servers.items()):
            stats = server.stats()
            depth.add_metric(labels, stats.queue_depth)
            compiles.add_metric(labels, stats.compiles)
            if isinstance(stats, GenerationStats):
                for key, gauge in slots.items():
                    gauge.add_metric(labels, getattr(stats, key))
            replica_stats = getattr(server, "replica_stats", None)  # a cluster serving's local front
            if replica_stats is None:
                continue
            clustered = True
            for replica_name, one in replica_stats().items():
                for key, family in replica.items():
                    family.add_metric([*labels, replica_name], getattr(one, key, 0))
                replica_depth.add_metric([*labels, replica_name], one.queue_depth)
        yield depth
        yield compiles
        yield from slots.values()
        if clustered:  # only a front of cluster servings has replicas to report
            yield from replica.values()
            yield replica_depth


class _Observer(NamedTuple):
    """A front's reports, observed into one model version's histograms."""

    batch: Callable[[BatchReport], None]
    step: Callable[[str, float], None]


class Metrics:
    """One registry per network front (so that several fronts in one process do not collide); models come
    and go with :meth:`add` and :meth:`remove`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("jitserve_requests", "Inference requests", [*LABELS, "protocol", "status"],
                                registry=self.registry)
        self.request_seconds = Histogram("jitserve_request_seconds", "Time of a request in the service, from its "
                                         "arrival to its last output, answered or failed", LABELS,
                                         buckets=(*_TIME_BUCKETS, 30, 60, 120), registry=self.registry)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):  # CPU, memory, descriptors, GC
            collector(registry=self.registry)
        self.batch_size = Histogram("jitserve_batch_size", "Executed batch size, padding included", LABELS,
                                    buckets=_BATCH_BUCKETS, registry=self.registry)
        self.padding = Counter("jitserve_padding_rows", "Padding rows executed", LABELS, registry=self.registry)
        self.queue_wait = Histogram("jitserve_queue_wait_seconds", "Time each request waited in the queue before "
                                    "its first rows ran, by batch", LABELS, buckets=_TIME_BUCKETS,
                                    registry=self.registry)
        self.execution = Histogram("jitserve_execution_seconds", "Execution time of each batch", LABELS,
                                   buckets=_TIME_BUCKETS, registry=self.registry)
        self.generation = {  # per generation server and per kind of event it tells
            kind: Histogram(f"jitserve_generation_{kind}_seconds", help, LABELS, buckets=_TIME_BUCKETS,
                            registry=self.registry) for kind, help in _GENERATION_TIMES.items()}
        self.servers: dict[tuple[str, str], Front] = {}
        self.registry.register(_ServerStats(self.servers))

    def add(self, model: str, version: str, server: Front) -> None:
        """Report ``server`` as ``model`` at ``version`` (replacing the server reported there before)."""
        self.servers[(model, version)] = server
        server.listen(_Observer(self._batch_listener(model, version), self._generation_listener(model, version)))

    def remove(self, model: str, version: str) -> None:
        """Stop reporting ``model`` at ``version`` from its server's stats (its histograms keep their counts)."""
        self.servers.pop((model, version), None)

    def _generation_listener(self, model: str, version: str) -> Callable[[str, float], None]:
        children = {kind: metric.labels(model, version) for kind, metric in self.generation.items()}

        def observe(kind: str, seconds: float) -> None:
            children[kind].observe(seconds)

        return observe

    def _batch_listener(self, model: str, version: str) -> Callable[[BatchReport], None]:
        # labels() takes a lock and builds a key: once per model, not per batch
        batch_size, padding = self.batch_size.labels(model, version), self.padding.labels(model, version)
        queue_wait, execution = self.queue_wait.labels(model, version), self.execution.labels(model, version)

        def observe(report: BatchReport) -> None:
            batch_size.observe(report.padded_size)
            padding.inc(report.padded_size - report.size)
            for wait in report.queue_waits_s:
                queue_wait.observe(wait)
            execution.observe(report.execution_s)

        return observe

    def render(self) -> bytes:
        return generate_latest(self.registry)
