"""Waiting in tests for what a busy machine reaches late: a test waits for a condition (a request in flight, a
queue this deep, an answer), never for a while, and asserts the property once it holds; and requests that a test
needs planned together, queued before their generation server starts."""

from __future__ import annotations

import concurrent.futures
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


def generated_at_once(generation: js.Generation, requests: list[tuple[Any, dict[str, Any]]],
                      max_steps: int) -> tuple[list[Any], GenerationStats]:
    """Each ``(prompt, sampling options)`` of ``requests`` answered, as ``js.generate`` answers it, by a server
    of ``generation`` that starts only once every request waits in its queue: its first plan sees them all,
    however late a busy machine runs their callers' threads. The answers, in order, and the server's
    statistics once it stopped."""
    server = unstarted_server(generation, "at-once")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = [pool.submit(server.call, Prompt(prompt, max_steps, js.Sampling(**options), timeout=HANG_S))
                   for prompt, options in requests]
        until(lambda: server.stats().queue_depth == len(requests), f"{len(requests)} requests queued")
        server.start()
        try:
            return [answer.result(HANG_S) for answer in answers], server.stats()
        finally:
            server.stop(drain=False)
