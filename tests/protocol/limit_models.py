"""Models the limits tests serve: ``jitserve serve tests/protocol/limit_models.py:models``."""

import time

import jax.numpy as jnp

import jitserve as js

SPREAD = 2**20  # "spread" answers each row with this many float32 values (4 MiB)


def sleepy(x):
    time.sleep(0.05)
    return x + 1


models = {
    "bulk": js.Serving(lambda x: x * 2, batch_size=2**18, batch_sizes=[2**18], batch_timeout=0.001,
                       input_template=js.template((16,), "float32")),
    "spread": js.Serving(lambda x: jnp.broadcast_to(x, (x.shape[0], SPREAD)), batch_size=4, batch_timeout=0.001,
                         input_template=js.template((1,), "float32")),
    "sleepy": js.Serving(sleepy, batch_size=64, batch_timeout=0.001, compiler="eager", max_queue=100_000,
                         input_template=js.template((1,), "float32")),
}
