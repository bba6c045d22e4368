"""Models the BF16 tests serve: ``jitserve serve tests/protocol/wire_models.py:models``."""

import importlib.util
from pathlib import Path

import jax.numpy as jnp

import jitserve as js

_spec = importlib.util.spec_from_file_location("jitserve_wire_network_models",
                                               Path(__file__).with_name("network_models.py"))
network = importlib.util.module_from_spec(_spec)  # the bundled mlp example, and a model with BYTES in and out
_spec.loader.exec_module(network)


def halve(x):
    """bfloat16 rows in: each halved (bfloat16, exact) and their sum (float32)."""
    return {"half": x / 2, "total": jnp.sum(x.astype(jnp.float32), axis=-1)}


models = {
    "mlp": network.example.serving,
    "text": network.text_serving,
    "halve": js.Serving(halve, batch_size=4, batch_timeout=0.001, input_template=js.template((4,), jnp.bfloat16)),
}
