"""Closed-loop load: N callers calling back to back for a fixed time, bounded in count and time.

Used by ``jitserve bench`` and the scripts in ``bench/``. A caller is built per
seed by ``make_call(seed)``; each call returns how many rows it served. Threads
run blocking calls; tasks on one event loop run coroutines.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadResult:
    rows_per_s: float
    calls: int
    latencies: list[float]

    def percentile(self, q: int) -> float:
        """The q-th percentile latency in seconds."""
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else float("nan")
        return statistics.quantiles(self.latencies, n=100)[q - 1]


def closed_loop(make_call: Callable[[int], Callable[[], int]], callers: int, seconds: float) -> LoadResult:
    """``callers`` threads, each calling its own ``make_call(seed)()`` until ``seconds`` have passed."""
    latencies: list[float] = []
    rows = [0]
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def worker(seed: int) -> None:
        call = make_call(seed)
        mine, done = [], 0
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            done += call()
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)
            rows[0] += done

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LoadResult(rows[0] / (time.perf_counter() - start), len(latencies), latencies)


def closed_loop_async(make_call: Callable[[int], Callable[[], Awaitable[int]]], callers: int,
                      seconds: float, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
                      ) -> LoadResult:
    """``callers`` tasks on one new event loop (from ``loop_factory``, e.g. ``uvloop.new_event_loop``; asyncio's
    by default), each awaiting its own ``make_call(seed)()`` until ``seconds``."""
    latencies: list[float] = []

    async def worker(seed: int, stop_at: float) -> int:
        call = make_call(seed)
        done = 0
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            done += await call()
            latencies.append(time.perf_counter() - started)
        return done

    async def main() -> float:
        start = time.perf_counter()
        rows = await asyncio.gather(*(worker(seed, start + seconds) for seed in range(callers)))
        return sum(rows) / (time.perf_counter() - start)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        rows_per_s = runner.run(main())
    return LoadResult(rows_per_s, len(latencies), latencies)
