"""The pieces the model families share, in plain ``jax.numpy``: norms, activations, rotary positions,
attention over a KV cache (grouped-query where a family has fewer key/value heads than query heads), and
the decoder loop that turns a family's blocks into ``js.Generation``'s ``prefill`` and ``decode``.

Norms and softmax are computed in float32 and cast back, as ``transformers`` does, so that a bfloat16
checkpoint rounds where the reference rounds; logits leave in float32."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

PAGED_READ_BLOCKS = 4  # the blocks of each sequence one turn of paged attention reads (64 positions of 16)


def layer_norm(x: Any, p: dict[str, Any], eps: float) -> Any:
    """LayerNorm with ``p["weight"]`` and ``p["bias"]``."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    variance = ((h - mean) ** 2).mean(-1, keepdims=True)
    h = (h - mean) / jnp.sqrt(variance + eps)
    return (h * p["weight"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm as Llama's: normalised in float32, cast back, then scaled."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def _gelu_tanh(x: Any) -> Any:
    return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# config.json's activation names (transformers' ACT2FN) -> jax
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def linear(x: Any, p: dict[str, Any]) -> Any:
    """torch's ``Linear``: ``weight`` is (out, in); ``bias`` where the checkpoint has one."""
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def conv1d(x: Any, p: dict[str, Any]) -> Any:
    """GPT-2's ``Conv1D``: ``weight`` is (in, out)."""
    return x @ p["weight"] + p["bias"]


def split_heads(x: Any, heads: int) -> Any:
    """(S, heads * D) -> (heads, S, D)."""
    return jnp.swapaxes(x.reshape(x.shape[0], heads, -1), 0, 1)


def merge_heads(x: Any) -> Any:
    """(heads, S, D) -> (S, heads * D)."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], -1)


def rotate(x: Any, positions: Any, inv_freq: np.ndarray) -> Any:
    """Rotary position embedding (the halves layout of ``transformers``' ``rotate_half``) of ``x`` (heads, S,
    D) at ``positions`` (S,), computed in float32."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attend(q: Any, k: Any, v: Any, visible: Any, scale: float) -> Any:
    """Scaled dot-product attention of ``q`` (H, S, D) over ``k`` and ``v`` (KV, T, D), H a multiple of KV
    (each group of H / KV query heads reads one key/value head); ``visible`` (S, T) is True where a query
    may see a key. Softmax in float32."""
    heads, length, depth = q.shape
    groups = q.reshape(k.shape[0], heads // k.shape[0], length, depth)
    scores = jnp.einsum("kgsd,ktd->kgst", groups, k).astype(jnp.float32) * scale
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("kgst,ktd->kgsd", weights, v).reshape(heads, length, v.shape[-1])


class Decoder(Protocol):
    """What a causal LM family gives the shared decoder loop: embeddings, each block in two halves around
    attention, and the head."""

    layers: int
    kv_heads: int
    head_dim: int
    scale: float

    def embed(self, params: Any, tokens: Any, positions: Any) -> Any: ...

    def blocks(self, params: Any) -> list[Any]: ...

    def qkv(self, block: Any, x: Any, positions: Any) -> tuple[Any, Any, Any]: ...

    def finish(self, block: Any, x: Any, mixed: Any) -> Any: ...

    def logits(self, params: Any, x: Any) -> Any: ...


def forward(model: Decoder, params: Any, tokens: Any) -> Any:
    """The logits of every position of one sequence (causal, no cache): what the tests compare."""
    positions = jnp.arange(tokens.shape[0])
    x = model.embed(params, tokens, positions)
    causal = positions[None, :] <= positions[:, None]
    for block in model.blocks(params):
        q, k, v = model.qkv(block, x, positions)
        x = model.finish(block, x, attend(q, k, v, causal, model.scale))
    return model.logits(params, x)


def prefill(model: Decoder, max_length: int, params: Any, tokens: Any, length: Any) -> tuple[Any, Any]:
    """``js.Generation``'s prefill: one prompt padded to a compiled length -> its KV cache row (every layer's
    keys and values, room for ``max_length`` positions) and the logits of the first new token."""
    positions = jnp.arange(tokens.shape[0])
    x = model.embed(params, tokens, positions)
    causal = positions[None, :] <= positions[:, None]
    keys, values = [], []
    room = ((0, 0), (0, max_length - tokens.shape[0]), (0, 0))
    for block in model.blocks(params):
        q, k, v = model.qkv(block, x, positions)
        keys.append(jnp.pad(k, room))
        values.append(jnp.pad(v, room))
        x = model.finish(block, x, attend(q, k, v, causal, model.scale))
    last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=True)
    return {"k": jnp.stack(keys), "v": jnp.stack(values), "position": length}, model.logits(params, last)[0]


def _decode_one(model: Decoder, params: Any, state: Any, token: Any) -> tuple[Any, Any]:
    position = state["position"]
    x = model.embed(params, token[None], position[None])
    visible = (jnp.arange(state["k"].shape[-2]) <= position)[None, :]
    cache_k, cache_v = state["k"], state["v"]
    for layer, block in enumerate(model.blocks(params)):
        q, k, v = model.qkv(block, x, position[None])
        # one position of one layer written into the whole cache: updated in place, never copied
        cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), (layer, 0, position, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), (layer, 0, position, 0))
        x = model.finish(block, x, attend(q, cache_k[layer], cache_v[layer], visible, model.scale))
    return {"k": cache_k, "v": cache_v, "position": position + 1}, model.logits(params, x)[0]


def decode(model: Decoder, params: Any, state: Any, last: Any) -> tuple[Any, Any]:
    """``js.Generation``'s step, every slot at once: each slot's last token in, its next token's logits out."""
    return jax.vmap(lambda row, token: _decode_one(model, params, row, token))(state, last)


def paged_forward(model: Decoder, block_size: int, params: Any, cache: Any, tokens: Any, positions: Any,
                  tables: Any, last: Any) -> tuple[Any, Any]:
    """``js.Generation``'s ``forward`` over a paged cache (see :mod:`jitserve.serving.generation.paged_programs`):
    rows of ``tokens`` at their ``positions`` (rows, n) write their keys and values through their rows of the
    block ``tables`` (a position past a table goes to the reserved block 0) and attend over their own
    sequence up to their own position; the logits of each row's token ``last``."""
    rows, length = tokens.shape
    width = tables.shape[1]
    index = positions // block_size
    blocks = jnp.take_along_axis(tables, jnp.minimum(index, width - 1), axis=1)
    writes = (jnp.where(index < width, blocks, 0) * block_size + positions % block_size).reshape(-1)
    x = jax.vmap(model.embed, in_axes=(None, 0, 0))(params, tokens, positions)
    keys, values = cache["k"], cache["v"]

    def written(new: Any) -> Any:  # (rows, heads, n, depth) -> one (heads, depth) per token, as the pool holds them
        return jnp.swapaxes(new, 1, 2).reshape(rows * length, *new.shape[1::2]).astype(keys.dtype)

    for layer, block in enumerate(model.blocks(params)):
        q, k, v = jax.vmap(model.qkv, in_axes=(None, 0, 0))(block, x, positions)
        keys = keys.at[layer, writes].set(written(k))
        values = values.at[layer, writes].set(written(v))
        mixed = paged_attend(q, keys, values, layer, tables, positions, block_size, model.scale)
        x = jax.vmap(model.finish, in_axes=(None, 0, 0))(block, x, mixed)
    hidden = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return {"k": keys, "v": values}, model.logits(params, hidden)


def paged_attend(q: Any, keys: Any, values: Any, layer: int, tables: Any, positions: Any, block_size: int,
                 scale: float) -> Any:
    """Rows of queries ``q`` (rows, H, n, D) at their ``positions`` (rows, n) attend over their own sequence
    in layer ``layer`` of the pool (``keys``, ``values``: (layers, blocks x block size, KV, D)) up to each
    query's own position, through their rows of the block ``tables``. The blocks are read
    :data:`PAGED_READ_BLOCKS` at a time, only as far as the furthest position of any row (a loop with an
    online softmax in float32, as flash-decoding does): a launch reads the blocks its sequences hold, not
    the table's width, and never gathers a sequence's whole context at once (XLA's CPU gather of that and
    the products over it cost 3-4x the loop's at 8-32 sequences)."""
    rows, heads, count, depth = q.shape
    kv_heads = keys.shape[2]
    span = PAGED_READ_BLOCKS * block_size
    padded = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % PAGED_READ_BLOCKS)))
    offsets = jnp.arange(block_size)
    turns = jnp.minimum(jnp.max(positions) // span + 1, padded.shape[1] // PAGED_READ_BLOCKS)
    groups = q.reshape(rows, kv_heads, heads // kv_heads, count, depth)
    lowest = jnp.finfo(jnp.float32).min

    def turn(i: Any, carry: Any) -> Any:
        best, total, mixed = carry
        read = jax.lax.dynamic_slice_in_dim(padded, i * PAGED_READ_BLOCKS, PAGED_READ_BLOCKS, axis=1)
        index = (read[:, :, None] * block_size + offsets).reshape(rows, span)
        k, v = keys[layer, index], values[layer, index]  # one gather from the pool: no copy of a layer
        seen = ((i * span + jnp.arange(span))[None, None, :] <= positions[:, :, None])[:, None, None]
        scores = jnp.einsum("rkgsd,rtkd->rkgst", groups, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(seen, scores, lowest)
        top = jnp.maximum(best, scores.max(-1))
        weights = jnp.where(seen, jnp.exp(scores - top[..., None]), 0.0)
        fade = jnp.exp(best - top)
        mixed = mixed * fade[..., None] + jnp.einsum("rkgst,rtkd->rkgsd", weights.astype(v.dtype), v,
                                                     preferred_element_type=jnp.float32)
        return top, total * fade + weights.sum(-1), mixed

    shape = (rows, kv_heads, heads // kv_heads, count)
    start = (jnp.full(shape, lowest), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, depth), jnp.float32))
    _, total, mixed = jax.lax.fori_loop(0, turns, turn, start)
    return (mixed / total[..., None]).reshape(rows, heads, count, depth).astype(values.dtype)
