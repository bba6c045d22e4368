"""The Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Phi3ForCausalLM``) over its checkpoint's own key names: RMSNorm, rotary positions
(``default``, ``linear`` and ``llama3`` scaling), grouped-query attention, a SwiGLU MLP, the head tied or
untied. They differ only as :data:`VARIANTS` says: which biases they carry (Qwen2: q, k and v), an RMSNorm
on each head of q and k before the rotation (Qwen3), q, k and v stored as one weight and the MLP's gate and
up as another (Phi-3 and Phi-4: split at load), and which attention windows they may declare (refused, by
name, where a window would be shorter than what is served)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, Fused
from .layers import ACTIVATIONS, linear, merge_heads, rms_norm, rotate, split_heads

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Variant:
    """How one architecture differs from Llama. A bias is always there (True), never (False), or where
    config.json's ``attention_bias`` (q, k, v and o) or ``mlp_bias`` says (None)."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``), before the rotation
    window_switch: str | None = None  # the field that must be false (its ``sliding_window`` is then inert)
    fused: bool = False  # q, k and v stored as one weight, and the MLP's gate and up (:data:`FUSIONS`)


VARIANTS = {  # architecture -> its variant
    "LlamaForCausalLM": Variant(),
    "MistralForCausalLM": Variant(qkv_bias=False, o_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": Variant(qkv_bias=True, o_bias=False, mlp_bias=False, window_switch="use_sliding_window"),
    "Qwen3ForCausalLM": Variant(mlp_bias=False, qk_norm=True, window_switch="use_sliding_window"),
    "Phi3ForCausalLM": Variant(qkv_bias=False, o_bias=False, mlp_bias=False, fused=True),
}
# a fused weight of a block -> the weights it holds, in its rows' order; split at load, so that one forward
# computes every variant (and tensor parallel splits the parts as Llama's)
FUSIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class Llama:
    """The decoder of one Llama-family config (see :class:`~jitserve.models.layers.Decoder`)."""

    def __init__(self, checkpoint: Checkpoint, task: str, max_length: int) -> None:
        c = checkpoint
        self.width = c.dimension("hidden_size")
        self.inner = c.dimension("intermediate_size")
        self.layers = c.blocks("num_hidden_layers")
        self.heads = c.dimension("num_attention_heads")
        self.kv_heads = c.dimension("num_key_value_heads", self.heads)
        self.head_dim = c.dimension("head_dim", self.width // self.heads)
        self.context = c.count("max_position_embeddings")
        self.vocabulary = c.dimension("vocab_size")
        self.eps = c.number("rms_norm_eps", 1e-6)
        self.activation = ACTIVATIONS[c.choice("hidden_act", "silu", ACTIVATIONS)]
        self.tied = bool(c.field("tie_word_embeddings", False, bool))
        self.tied_head = ("lm_head.weight", "model.embed_tokens.weight") if self.tied else None
        variant = VARIANTS[str(c.architecture)]  # one of them: pretrained.ARCHITECTURES has refused others

        def bias(fixed: bool | None, field: str) -> bool:
            return bool(c.field(field, False, bool)) if fixed is None else fixed

        self.qkv_bias, self.o_bias = bias(variant.qkv_bias, "attention_bias"), bias(variant.o_bias, "attention_bias")
        self.mlp_bias = bias(variant.mlp_bias, "mlp_bias")
        self.qk_norm, self.fuses = variant.qk_norm, variant.fused
        if self.heads % self.kv_heads:
            raise c.unsupported("num_key_value_heads", self.kv_heads,
                                f"it must divide num_attention_heads ({self.heads})")
        if variant.window_switch:
            c.choice(variant.window_switch, False, [False])
        window = c.field("sliding_window", None, int)
        if not variant.window_switch and window is not None and window < max_length:
            raise c.unsupported("sliding_window", window, f"attention over a sliding window; it is served here "
                                f"only where max_length ({max_length}) fits in the window")
        self.scale = 1 / math.sqrt(self.head_dim)
        self.inv_freq = rope_frequencies(c, self.head_dim)

    def weights(self) -> dict[str, tuple[int, ...]]:
        expected = self._unfused()
        for name, parts in (self.fused or {}).items():
            expected[name] = (sum(expected.pop(part)[0] for part, _ in parts), self.width)
        return expected

    @property
    def fused(self) -> Fused | None:
        """The weights stored fused (:data:`FUSIONS`), each with the parts it is split into at load."""
        rows = {name: shape[0] for name, shape in self._unfused().items()}
        return {f"{block}{name}.weight": [(f"{block}{part}.weight", rows[f"{block}{part}.weight"]) for part in parts]
                for block in (f"model.layers.{i}." for i in range(self.layers))
                for name, parts in FUSIONS.items()} if self.fuses else None

    def _unfused(self) -> dict[str, tuple[int, ...]]:
        d, inner, q, kv = self.width, self.inner, self.heads * self.head_dim, self.kv_heads * self.head_dim
        expected = {"model.embed_tokens.weight": (self.vocabulary, d), "model.norm.weight": (d,)}
        for i in range(self.layers):
            block = f"model.layers.{i}."
            shapes = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                      "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                      "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                      "mlp.gate_proj.weight": (inner, d), "mlp.up_proj.weight": (inner, d),
                      "mlp.down_proj.weight": (d, inner)}
            if self.qkv_bias:
                shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                               "self_attn.v_proj.bias": (kv,)})
            if self.o_bias:
                shapes["self_attn.o_proj.bias"] = (d,)
            if self.qk_norm:
                shapes.update({f"self_attn.{name}_norm.weight": (self.head_dim,) for name in "qk"})
            if self.mlp_bias:
                shapes.update({"mlp.gate_proj.bias": (inner,), "mlp.up_proj.bias": (inner,),
                               "mlp.down_proj.bias": (d,)})
            expected.update({block + name: shape for name, shape in shapes.items()})
        if not self.tied:
            expected["lm_head.weight"] = (self.vocabulary, d)
        return expected

    def ignored(self) -> list[str]:
        """Rotary frequencies some checkpoints saved (derived from the config here)."""
        return [r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"]

    def embed(self, params: Any, tokens: Any, positions: Any) -> Any:
        return params["model"]["embed_tokens"]["weight"][tokens]

    def blocks(self, params: Any) -> list[Any]:
        return params["model"]["layers"]

    def qkv(self, block: Any, x: Any, positions: Any) -> tuple[Any, Any, Any]:
        h = rms_norm(x, block["input_layernorm"]["weight"], self.eps)
        attention = block["self_attn"]
        q = split_heads(linear(h, attention["q_proj"]), self.heads)
        k = split_heads(linear(h, attention["k_proj"]), self.kv_heads)
        v = split_heads(linear(h, attention["v_proj"]), self.kv_heads)
        if self.qk_norm:
            q = rms_norm(q, attention["q_norm"]["weight"], self.eps)
            k = rms_norm(k, attention["k_norm"]["weight"], self.eps)
        return rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq), v

    def finish(self, block: Any, x: Any, mixed: Any) -> Any:
        x = x + linear(merge_heads(mixed), block["self_attn"]["o_proj"])
        h = rms_norm(x, block["post_attention_layernorm"]["weight"], self.eps)
        mlp = block["mlp"]
        return x + linear(self.activation(linear(h, mlp["gate_proj"])) * linear(h, mlp["up_proj"]), mlp["down_proj"])

    def logits(self, params: Any, x: Any) -> Any:
        head = params["model"]["embed_tokens"]["weight"] if self.tied else params["lm_head"]["weight"]
        return (rms_norm(x, params["model"]["norm"]["weight"], self.eps) @ head.T).astype(np.float32)


def rope_frequencies(c: Checkpoint, head_dim: int) -> np.ndarray:
    """The rotary inverse frequencies, float32, as ``transformers`` computes them: from ``rope_parameters``
    (transformers 5) or ``rope_theta`` and ``rope_scaling`` (older checkpoints); a scaling type other than
    ``ROPE_TYPES`` is refused by name."""
    parameters = c.field("rope_parameters", None, dict)
    name = "rope_parameters"
    if parameters is None:
        name = "rope_scaling"
        parameters = {"rope_theta": c.number("rope_theta", 10000.0), **(c.field("rope_scaling", None, dict) or {})}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise c.unsupported(name, parameters, f"rope type {kind!r}; jitserve implements {', '.join(ROPE_TYPES)}")
    factor = parameters.get("partial_rotary_factor", c.field("partial_rotary_factor", 1.0))
    if factor != 1:
        raise c.unsupported("partial_rotary_factor", factor, "rotary positions over part of each head")
    theta = np.float32(parameters.get("rope_theta", c.field("rope_theta", 10000.0)))
    inv_freq = np.float32(1) / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))

    def needed(key: str) -> np.float32:
        if not isinstance(parameters.get(key), int | float):
            raise c.unsupported(name, parameters, f"rope type {kind!r} needs a number {key!r}")
        return np.float32(parameters[key])

    if kind == "linear":
        return (inv_freq / needed("factor")).astype(np.float32)
    if kind == "llama3":
        scale, low, high = needed("factor"), needed("low_freq_factor"), needed("high_freq_factor")
        old = needed("original_max_position_embeddings")
        wavelength = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelength > old / low, inv_freq / scale, inv_freq)
        smooth = (old / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / scale + smooth * scaled
        medium = (wavelength >= old / high) & (wavelength <= old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq.astype(np.float32)
