"""A bundled example model: a small MLP (16 -> 64 -> 4, float32), served with dynamic batching.

    jitserve serve examples/mlp.py:serving
"""

import jax.numpy as jnp
import numpy as np

import jitserve as js

rng = np.random.default_rng(0)
W1 = rng.normal(0, 0.25, (16, 64)).astype(np.float32)
W2 = rng.normal(0, 0.25, (64, 4)).astype(np.float32)


def mlp(x):
    """Rows of 16 features -> rows of 4 class probabilities."""
    hidden = jnp.maximum(x @ W1, 0.0)
    logits = hidden @ W2
    return jnp.exp(logits) / jnp.sum(jnp.exp(logits), axis=-1, keepdims=True)


serving = js.Serving(mlp, batch_size=32, batch_timeout=0.002, input_template=js.template((16,), "float32"))
