"""A bundled example model: a small MLP (16 -> 64 -> 4, float32), served with dynamic batching.

Its weights are ``params``: each partition holds them on its device and every
compiled batch size takes them as inputs (see the README's "Models with
weights"); ``server.update_params`` swaps them without a compile.

    jitserve serve examples/mlp.py:serving
"""

import jax.numpy as jnp
import numpy as np

import jitserve as js

rng = np.random.default_rng(0)
W1 = rng.normal(0, 0.25, (16, 64)).astype(np.float32)
W2 = rng.normal(0, 0.25, (64, 4)).astype(np.float32)


def mlp(params, x):
    """Rows of 16 features -> rows of 4 class probabilities."""
    hidden = jnp.maximum(x @ params["w1"], 0.0)
    logits = hidden @ params["w2"]
    return jnp.exp(logits) / jnp.sum(jnp.exp(logits), axis=-1, keepdims=True)


serving = js.Serving(mlp, params={"w1": W1, "w2": W2}, batch_size=32, batch_timeout=0.002,
                     input_template=js.template((16,), "float32"))
