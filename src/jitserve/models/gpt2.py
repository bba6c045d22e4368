"""GPT-2 (``GPT2LMHeadModel``) over its checkpoint's own key names: learned positions, pre-norm blocks of
fused-QKV attention and a GELU MLP (GPT-2's ``Conv1D`` weights, (in, out)), the head tied to the token
embedding unless ``tie_word_embeddings`` is false."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from .checkpoint import Checkpoint
from .layers import ACTIVATIONS, conv1d, layer_norm, merge_heads, split_heads


class GPT2:
    """The decoder of one GPT-2 config (see :class:`~jitserve.models.layers.Decoder`)."""

    def __init__(self, checkpoint: Checkpoint, task: str, max_length: int) -> None:
        c = checkpoint
        self.width = c.dimension("n_embd")
        self.heads = c.dimension("n_head")
        self.layers = c.blocks("n_layer")
        self.context = c.dimension("n_positions")
        self.vocabulary = c.dimension("vocab_size")
        self.inner = c.dimension("n_inner", 4 * self.width)
        self.eps = c.number("layer_norm_epsilon", 1e-5)
        self.activation = ACTIVATIONS[c.choice("activation_function", "gelu_new", ACTIVATIONS)]
        self.tied = bool(c.field("tie_word_embeddings", True, bool))
        self.tied_head = ("lm_head.weight", "transformer.wte.weight") if self.tied else None
        self.fused = None  # c_attn, q k and v in one, is computed as stored
        c.choice("scale_attn_by_inverse_layer_idx", False, [False])
        c.choice("add_cross_attention", False, [False])
        if self.width % self.heads:
            raise c.unsupported("n_head", self.heads, f"it must divide n_embd ({self.width})")
        self.kv_heads, self.head_dim = self.heads, self.width // self.heads
        self.scale = 1 / math.sqrt(self.width // self.heads) if c.field("scale_attn_weights", True, bool) else 1.0

    def weights(self) -> dict[str, tuple[int, ...]]:
        d, inner = self.width, self.inner
        expected = {"transformer.wte.weight": (self.vocabulary, d), "transformer.wpe.weight": (self.context, d),
                    "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
        for i in range(self.layers):
            block = f"transformer.h.{i}."
            for name, shape in {"ln_1.weight": (d,), "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
                                "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
                                "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
                                "mlp.c_fc.weight": (d, inner), "mlp.c_fc.bias": (inner,),
                                "mlp.c_proj.weight": (inner, d), "mlp.c_proj.bias": (d,)}.items():
                expected[block + name] = shape
        if not self.tied:
            expected["lm_head.weight"] = (self.vocabulary, d)
        return expected

    def ignored(self) -> list[str]:
        """The causal-mask buffers older checkpoints saved."""
        return [r"transformer\.h\.\d+\.attn\.(masked_)?bias"]

    def embed(self, params: Any, tokens: Any, positions: Any) -> Any:
        t = params["transformer"]
        return t["wte"]["weight"][tokens] + t["wpe"]["weight"][positions]

    def blocks(self, params: Any) -> list[Any]:
        return params["transformer"]["h"]

    def qkv(self, block: Any, x: Any, positions: Any) -> tuple[Any, Any, Any]:
        q, k, v = jnp.split(conv1d(layer_norm(x, block["ln_1"], self.eps), block["attn"]["c_attn"]), 3, axis=-1)
        return split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads)

    def finish(self, block: Any, x: Any, mixed: Any) -> Any:
        x = x + conv1d(merge_heads(mixed), block["attn"]["c_proj"])
        inner = self.activation(conv1d(layer_norm(x, block["ln_2"], self.eps), block["mlp"]["c_fc"]))
        return x + conv1d(inner, block["mlp"]["c_proj"])

    def logits(self, params: Any, x: Any) -> Any:
        t = params["transformer"]
        head = t["wte"]["weight"] if self.tied else params["lm_head"]["weight"]
        return (layer_norm(x, t["ln_f"], self.eps) @ head.T).astype(jnp.float32)
