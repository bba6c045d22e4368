"""Generations the network tests serve: ``jitserve serve tests/protocol/generation_models.py:models``.

The toy model of tests/serving/test_generation.py: its state is (position, running sum), its next token
the sum modulo ``VOCAB``, given as peaked logits so that the server picks (greedy) or samples the token."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js

VOCAB = 97


def prefill(params, tokens, length):
    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0))
    return {"position": length, "total": total}, peaked(total % VOCAB)


def decode(params, state, last):
    total = state["total"] + last + state["position"]
    return {"position": state["position"] + 1, "total": total}, jax.vmap(peaked)(total % VOCAB)


def slow_decode(params, state, last):
    time.sleep(0.05)
    return decode(params, state, last)


def peaked(token):
    return -jnp.abs(jnp.arange(VOCAB) - token).astype(jnp.float32) / 4.0


def expected(prompt, steps, max_length=64):
    """The greedy tokens of ``prompt``."""
    total, position, out = int(np.sum(prompt)), len(prompt), []
    out.append(total % VOCAB)
    while len(out) < steps and len(prompt) + len(out) < max_length:
        total, position = total + out[-1] + position, position + 1
        out.append(total % VOCAB)
    return out


def encode(text):
    """A byte-level tokenizer: each UTF-8 byte of one string one token id."""
    if not isinstance(text, str | bytes):
        raise js.ModelError(f"a text prompt is one string; got {type(text).__name__}")  # a 400
    return np.frombuffer(text.encode() if isinstance(text, str) else text, np.uint8).astype(np.int32)


def piece(token):
    """A token's text: one printable ASCII byte."""
    return bytes([32 + int(token) % 95])


def expected_text(text, steps):
    return b"".join(piece(token) for token in expected(encode(text), steps))


models = {
    "gen": js.Generation(prefill, decode, params={}, slots=4, max_length=64, prefill_lengths=[8, 16],
                         logits=True),
    "slow": js.Generation(prefill, slow_decode, params={}, slots=2, max_length=512, prefill_lengths=[8],
                          logits=True, compiler="eager"),
    "text": js.Generation(prefill, decode, params={}, slots=4, max_length=64, prefill_lengths=[8, 16],
                          logits=True, preprocess=encode, postprocess=piece),
}
