"""Waiting in tests for what a busy machine reaches late: a test waits for a condition (a request in flight, a
queue this deep, an answer), never for a while, and asserts the property once it holds."""

from __future__ import annotations

import time
from collections.abc import Callable

# a bound only for a test that would otherwise hang on a bug: far beyond what a slow, busy machine needs
HANG_S = 120.0


def until(condition: Callable[[], object], what: str, seconds: float = HANG_S) -> None:
    """Return once ``condition()`` is true; an AssertionError naming ``what`` if it is not after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:.0f} s for {what}")
        time.sleep(0.001)
