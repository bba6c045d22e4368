"""Waiting in tests for what a busy machine reaches late: a test waits for a condition (a request in flight, a
queue this deep, an answer), never for a while, and asserts the property once it holds; and requests that a test
needs planned together, queued before their generation server starts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any

import jitserve as js
from jitserve.serving.generation.server import Prompt
from jitserve.serving.registry import unstarted_server
from jitserve.serving.stats import GenerationStats

# a bound only for a test that would otherwise hang on a bug: far beyond what a slow, busy machine needs
HANG_S = 120.0


def until(condition: Callable[[], object], what: str, seconds: float = HANG_S) -> None:
    """Return once ``condition()`` is true; an AssertionError naming ``what`` if it is not after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:.0f} s for {what}")
        time.sleep(0.001)


def answered(futures: list[concurrent.futures.Future[Any]], progress: Callable[[], object], what: str) -> list[Any]:
    """Each of ``futures``' results, waited for as long as it takes while ``progress()`` changes (a busy machine
    is slow, not stuck): an AssertionError naming ``what`` only once nothing has changed for ``HANG_S``."""
    pending, seen = set(futures), progress()
    while pending:
        done, pending = concurrent.futures.wait(pending, HANG_S, concurrent.futures.FIRST_COMPLETED)
        now = progress()
        if not done and now == seen:
            raise AssertionError(f"nothing moved for {HANG_S:.0f} s towards {what}")
        seen = now
    return [future.result() for future in futures]


def progress(stats: GenerationStats) -> tuple[int, ...]:
    """What grows as a generation server works: its prefills, launches and outputs."""
    return stats.prefills, stats.launches, stats.outputs


def generated_at_once(generation: js.Generation, requests: list[tuple[Any, dict[str, Any]]],
                      max_steps: int) -> tuple[list[Any], GenerationStats]:
    """Each ``(prompt, sampling options)`` of ``requests`` answered, as ``js.generate`` answers it, by a server
    of ``generation`` that starts only once every request waits in its queue: its first plan sees them all,
    however late a busy machine runs their callers' threads. The requests have no timeout: they wait for the
    server's warm-up, which takes what the machine needs. The answers, in order, and the server's statistics
    once it stopped."""
    server = unstarted_server(generation, "at-once")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = [pool.submit(server.call, Prompt(prompt, max_steps, js.Sampling(**options)))
                   for prompt, options in requests]
        until(lambda: server.stats().queue_depth == len(requests), f"{len(requests)} requests queued")
        try:
            server.start()
            return answered(answers, lambda: progress(server.stats()), f"{len(requests)} answers"), server.stats()
        finally:  # its requests end (a start that failed ends them too, then cannot join a loop it never ran)
            with contextlib.suppress(RuntimeError):
                server.stop(drain=False)
