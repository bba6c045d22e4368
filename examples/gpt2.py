"""A GPT-2-style decoder in plain ``jax.numpy`` over a params pytree, served with its weights as params.

The weights carry the names Hugging Face's ``GPT2LMHeadModel`` gives them
(``transformer.h.0.attn.c_attn.weight``, ...), so the same ``.safetensors``
file loads into both; ``tests/examples`` checks the two against each other.
Nothing is downloaded: the weights are made from a fixed seed and saved under
``examples/weights/`` on first use.

    jitserve serve examples/gpt2.py:serving     # model "gpt2": tokens + length in, next-token logits out

``serving`` takes a batch of prompts as token ids padded to ``CONTEXT`` and
their lengths, and returns the logits of the next token and the greedy choice.
``generation`` (``js.Generation``) decodes with a KV cache: ``prefill`` fills a
slot's cache row from a prompt, ``decode`` advances every slot by one greedy
token, attending over its own cache only. ``text_generation`` is the same
model with text in and text out, byte-level (each UTF-8 byte is the token of
its value, and it answers ASCII: tokens from 128 up are never picked, so
that each step's piece is text on its own):

    jitserve serve examples/gpt2.py:text_generation   # BYTES "prompt" in, one BYTES piece per step out

Set ``JITSERVE_GPT2=full`` for GPT-2's own size (124 M parameters, 500 MB).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js
from jitserve.params import save_params

CONFIGS = {
    "small": {"vocab_size": 512, "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4},
    "full": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
}
SIZE = os.environ.get("JITSERVE_GPT2", "small")
CONFIG = CONFIGS[SIZE]
CONTEXT = 32  # the prompt length the serving is compiled for, and generation's longest prompt
MAX_LENGTH = CONFIG["n_positions"]  # prompt and generated tokens, at most (the KV cache's room)
WEIGHTS = Path(__file__).resolve().parent / "weights" / f"gpt2-{SIZE}.safetensors"
LAYER_NORM_EPS = 1e-5


def init_params(config: dict, seed: int = 0) -> dict:
    """GPT-2's parameters, random from ``seed`` (normal; biases and layer norms random too, so that every
    parameter matters in the comparison with the reference)."""
    rng = np.random.default_rng(seed)
    d, vocab = config["n_embd"], config["vocab_size"]

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape, np.float32) * np.float32(std)).astype(np.float32)

    def norm():
        return {"weight": 1 + normal(d, std=0.1), "bias": normal(d)}

    def linear(n_in, n_out):  # GPT-2's Conv1D: weight (in, out)
        # wider than GPT-2's 0.02, so that the blocks and not the embedding alone pick the next token:
        # random weights then generate varied tokens rather than one token repeated
        return {"weight": normal(n_in, n_out, std=2.4 / np.sqrt(n_in)), "bias": normal(n_out)}

    blocks = [{"ln_1": norm(), "attn": {"c_attn": linear(d, 3 * d), "c_proj": linear(d, d)},
               "ln_2": norm(), "mlp": {"c_fc": linear(d, 4 * d), "c_proj": linear(4 * d, d)}}
              for _ in range(config["n_layer"])]
    return {"transformer": {"wte": {"weight": normal(vocab, d)}, "wpe": {"weight": normal(config["n_positions"], d)},
                            "h": blocks, "ln_f": norm()}}


def load(config: dict = CONFIG, path: Path = WEIGHTS) -> dict:
    """The weights from ``path``, made and saved there first if it does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_params(path, init_params(config))
    return js.load_params(path)


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(variance + LAYER_NORM_EPS) * p["weight"] + p["bias"]


def gelu(x):  # GPT-2's tanh approximation ("gelu_new")
    return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def linear(x, p):
    return x @ p["weight"] + p["bias"]


def heads(x, n_head):
    """(..., S, D) -> (..., H, S, D / H)."""
    *lead, s, d = x.shape
    return jnp.swapaxes(x.reshape(*lead, s, n_head, d // n_head), -2, -3)


def attend(q, k, v, mask):
    """Scaled dot-product attention; ``mask`` True where a query may see a key."""
    scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores, axis=-1) @ v


def qkv(p, x, n_head):
    """A block's queries, keys and values for ``x`` (S, D), heads split: (H, S, D / H) each."""
    q, k, v = jnp.split(linear(layer_norm(x, p["ln_1"]), p["attn"]["c_attn"]), 3, axis=-1)
    return heads(q, n_head), heads(k, n_head), heads(v, n_head)


def finish_block(p, x, mixed):
    """The rest of a block once attention mixed the values: projection, residuals and the MLP."""
    x = x + linear(jnp.swapaxes(mixed, -2, -3).reshape(x.shape), p["attn"]["c_proj"])
    return x + linear(gelu(linear(layer_norm(x, p["ln_2"]), p["mlp"]["c_fc"])), p["mlp"]["c_proj"])


def embed(params, tokens, positions):
    t = params["transformer"]
    return t["wte"]["weight"][tokens] + t["wpe"]["weight"][positions]


def logits_of(params, x):
    t = params["transformer"]
    return layer_norm(x, t["ln_f"]) @ t["wte"]["weight"].T


def forward(params, tokens, n_head=CONFIG["n_head"]):
    """The logits of every position of one sequence of token ids (causal)."""
    positions = jnp.arange(tokens.shape[0])
    x = embed(params, tokens, positions)
    causal = positions[None, :] <= positions[:, None]
    for p in params["transformer"]["h"]:
        q, k, v = qkv(p, x, n_head)
        x = finish_block(p, x, attend(q, k, v, causal))
    return logits_of(params, x)


def next_token(params, entry):
    """The served function: per prompt (token ids padded to ``CONTEXT``, and its length) the logits of the
    token after it and the greedy choice. Padding after the prompt is never attended to (causal)."""
    logits = jax.vmap(forward, in_axes=(None, 0))(params, entry["tokens"])
    last = jnp.take_along_axis(logits, (entry["length"] - 1)[:, None, None], axis=1)[:, 0]
    return {"logits": last, "next_token": jnp.argmax(last, axis=-1).astype(jnp.int32)}


def prefill(params, tokens, length, n_head=CONFIG["n_head"], max_length=MAX_LENGTH):
    """Generation's first half, for one prompt padded to a compiled length: the KV cache row (every
    layer's keys and values, room for ``max_length`` positions) and the logits of the first new token."""
    positions = jnp.arange(tokens.shape[0])
    x = embed(params, tokens, positions)
    causal = positions[None, :] <= positions[:, None]
    keys, values = [], []
    room = ((0, 0), (0, max_length - tokens.shape[0]), (0, 0))
    for p in params["transformer"]["h"]:
        q, k, v = qkv(p, x, n_head)
        keys.append(jnp.pad(k, room))
        values.append(jnp.pad(v, room))
        x = finish_block(p, x, attend(q, k, v, causal))
    last = logits_of(params, x[length - 1])
    state = {"k": jnp.stack(keys), "v": jnp.stack(values), "position": length}
    return state, last


def _decode_one(params, state, token, n_head):
    """One step of one sequence: the token at ``position`` goes through, its keys and values into the cache."""
    position = state["position"]
    x = embed(params, token[None], position[None])
    visible = (jnp.arange(state["k"].shape[-2]) <= position)[None, :]
    cache_k, cache_v = state["k"], state["v"]
    for layer, p in enumerate(params["transformer"]["h"]):
        q, k, v = qkv(p, x, n_head)
        # one position of one layer written into the whole cache: updated in place, never copied
        cache_k = jax.lax.dynamic_update_slice(cache_k, k[None], (layer, 0, position, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v[None], (layer, 0, position, 0))
        x = finish_block(p, x, attend(q, cache_k[layer], cache_v[layer], visible))
    return {"k": cache_k, "v": cache_v, "position": position + 1}, logits_of(params, x[0])


def decode(params, state, last, n_head=CONFIG["n_head"]):
    """Generation's step, every slot at once: each slot's last token in, the logits of its next token out
    (the server picks the token: greedy, or sampled as each request asks)."""
    return jax.vmap(_decode_one, in_axes=(None, 0, 0, None))(params, state, last, n_head)


def encode(text: str | bytes) -> np.ndarray:
    """A prompt's token ids, byte-level: each UTF-8 byte of one string the token of its value (this
    example's own tokenizer: nothing is downloaded). Anything but one string is the client's error (400)."""
    if not isinstance(text, str | bytes):
        raise js.ModelError(f"a text prompt is one string; got {type(text).__name__}")
    return np.frombuffer(text.encode() if isinstance(text, str) else text, np.uint8).astype(np.int32)


def as_bytes(token) -> bytes:
    """A generated token's text: its byte, ASCII (see ``ascii_only``)."""
    return bytes([int(token)])


def ascii_only(step):
    """``step`` (prefill or decode) with the logits of the tokens that are not ASCII bytes (128 and up) at
    -inf, so that every token picked, greedy or sampled, is a character of its own, whole UTF-8 text over
    JSON too (a byte from 128 up is only part of a character); ``suppress_tokens`` in transformers."""
    def masked(*arguments):
        state, logits = step(*arguments)
        return state, jnp.where(jnp.arange(logits.shape[-1]) < 128, logits, -jnp.inf)
    return masked


generation = js.Generation(prefill, decode, params=load(), slots=8, max_length=MAX_LENGTH,
                           prefill_lengths=[16, CONTEXT], logits=True)

text_generation = js.Generation(ascii_only(prefill), ascii_only(decode), params=load(), slots=8,
                                max_length=MAX_LENGTH, prefill_lengths=[16, CONTEXT], logits=True,
                                preprocess=encode, postprocess=as_bytes)

serving = js.Serving(next_token, params=load(), batch_size=8, batch_timeout=0.002,
                     input_template={"tokens": js.template((CONTEXT,), "int32"), "length": js.template((), "int32")})
