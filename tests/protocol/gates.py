"""Gates a test puts on the batches of a served model, so that it knows what runs and what waits in the queue
without timing: a gated model's batch writes a line to ``GATE/MODEL.started`` as it starts, then waits while
``GATE/MODEL.hold`` exists. ``GATE`` is the folder in ``$JITSERVE_TEST_GATE`` of the server's environment;
without it a gated model runs at once. The models' files import ``gated``; the tests, ``holding`` and
``started``, and ``gate_env`` to start the server with."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

VARIABLE = "JITSERVE_TEST_GATE"
GATE = os.environ.get(VARIABLE)


def gated(model: str) -> None:
    """Called first in each batch of ``model``, in the server."""
    if GATE:
        with open(Path(GATE, f"{model}.started"), "a") as started_file:
            started_file.write("batch\n")
        while Path(GATE, f"{model}.hold").exists():
            time.sleep(0.002)


def gate_env(gate: Path) -> dict[str, str]:
    """The environment that gates a server's models in the folder ``gate`` (``start_server(..., env=)``)."""
    return {VARIABLE: str(gate)}


@contextlib.contextmanager
def holding(gate: Path, model: str) -> Iterator[None]:
    """The batches of ``model`` wait once they start, until the block ends."""
    hold = gate / f"{model}.hold"
    hold.touch()
    try:
        yield
    finally:
        hold.unlink()


def started(gate: Path, model: str) -> int:
    """How many batches of ``model`` have started."""
    path = gate / f"{model}.started"
    return len(path.read_text().splitlines()) if path.exists() else 0
