"""Warm-up progress: what a server compiles before it takes requests, one step at a time, shown alike for
a Serving (each batch size on each partition) and a Generation (each prefill, slot update and decode
launch): a log line per compiled program, naming the server and the program and how long it took, and on a
terminal a tqdm bar over all of them, with the log lines routed around it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

Step = tuple[str, Callable[[], Any]]  # what it compiles ("batch size 8"), and the call that does it


def compile_each(log: logging.Logger, owner: str, steps: Sequence[Step]) -> None:
    """Run every step, logging ``"{owner}: compiled {what} in {seconds}s"`` after each (``owner``: "server
    NAME", "generation server NAME"), with a progress bar labelled ``owner`` while a terminal shows it."""
    with logging_redirect_tqdm(), tqdm(total=len(steps), desc=f"{owner}: compiling {len(steps)} programs",
                                       disable=not sys.stderr.isatty(), leave=False) as progress:
        for what, step in steps:
            started = time.perf_counter()
            step()
            log.info("%s: compiled %s in %.3fs", owner, what, time.perf_counter() - started)
            progress.update(1)
