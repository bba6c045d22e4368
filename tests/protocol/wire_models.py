"""Models the shared memory and BF16 tests serve: ``jitserve serve tests/protocol/wire_models.py:models``."""

import importlib.util
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

import jitserve as js

_spec = importlib.util.spec_from_file_location("jitserve_wire_network_models",
                                               Path(__file__).with_name("network_models.py"))
network = importlib.util.module_from_spec(_spec)  # the bundled mlp example, and a model with BYTES in and out
_spec.loader.exec_module(network)

GATES = Path(tempfile.gettempdir())


def gate_files(token: int) -> tuple[Path, Path]:
    """The files through which a test and ``gate`` meet: ``gate`` makes the first once it runs a request whose
    first value is ``token``, and returns once the test makes the second."""
    return GATES / f"jitserve-gate-{token}.started", GATES / f"jitserve-gate-{token}.go"


def gate(x):
    """x + 1, once the test says go (a request whose first value is 0, as warm-up's, goes at once)."""
    token = int(x[0, 0])
    if token:
        started, go = gate_files(token)
        started.touch()
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return x + 1


def halve(x):
    """bfloat16 rows in: each halved (bfloat16, exact) and their sum (float32)."""
    return {"half": x / 2, "total": jnp.sum(x.astype(jnp.float32), axis=-1)}


models = {
    "mlp": network.example.serving,
    "text": network.text_serving,
    "halve": js.Serving(halve, batch_size=4, batch_timeout=0.001, input_template=js.template((4,), jnp.bfloat16)),
    "gate": js.Serving(gate, batch_size=1, batch_timeout=0, compiler="eager",
                       input_template=js.template((2,), "float32")),
}
