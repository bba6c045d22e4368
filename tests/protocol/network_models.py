"""Models the network tests serve: ``jitserve serve tests/protocol/network_models.py:models``."""

import importlib.util
import time
from pathlib import Path

import jax.numpy as jnp

import jitserve as js

_spec = importlib.util.spec_from_file_location(
    "jitserve_example_mlp", Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
example = importlib.util.module_from_spec(_spec)  # the bundled example (examples/ is not a package)
_spec.loader.exec_module(example)


def affine(entry):
    return {"y": entry["x"] * entry["scale"][:, None] + 1.0, "norm": jnp.sqrt(jnp.sum(entry["x"] ** 2, axis=-1))}


def fragile(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return x


def slow(x):
    time.sleep(0.6)
    return x + 1


models = {
    "mlp": example.serving,
    "affine": js.Serving(affine, batch_size=8, batch_timeout=0.002,
                         input_template={"x": js.template((4,), "float32"), "scale": js.template((), "float32")}),
    "ints": js.Serving(lambda x: x * 2, batch_size=4, batch_timeout=0.002, input_template=js.template((3,), "int32")),
    "fragile": js.Serving(fragile, batch_size=4, batch_timeout=0.001, compiler="eager",
                          input_template=js.template((2,), "float32")),
    "slow": js.Serving(slow, batch_size=1, batch_timeout=0, max_queue=1, compiler="eager",
                       input_template=js.template((1,), "float32")),
}
