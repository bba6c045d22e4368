"""BERT (``BertModel``, ``BertForSequenceClassification``) over its checkpoint's own key names: word,
position and token-type embeddings, post-norm encoder layers, and either the pooler and classifier
(task ``classification``) or a pooled sentence vector (task ``embedding``: the mean over the attention
mask by default, or another of sentence-transformers' pooling modes, :data:`POOLINGS`; optionally
L2-normalised)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .checkpoint import Checkpoint
from .layers import ACTIVATIONS, layer_norm, linear, merge_heads, split_heads


def _mean(x: Any, weights: Any) -> Any:
    return (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)


def _last(x: Any, weights: Any) -> Any:
    last = jnp.maximum((weights[:, :, 0] > 0).sum(1) - 1, 0)
    return jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]


# sentence-transformers' pooling modes: one vector (B, D) of the hidden states (B, S, D) and the mask (B, S, 1)
POOLINGS: dict[str, Callable[[Any, Any], Any]] = {
    "mean": _mean,
    "cls": lambda x, weights: x[:, 0],
    "max": lambda x, weights: jnp.where(weights > 0, x, -jnp.inf).max(1),
    "mean_sqrt_len_tokens": lambda x, weights: (x * weights).sum(1) / jnp.sqrt(jnp.maximum(weights.sum(1), 1e-9)),
    "weightedmean": lambda x, weights: _mean(x, weights * jnp.arange(1, x.shape[1] + 1)[None, :, None]),
    "lasttoken": _last,
}


class Bert:
    """The encoder of one BERT config; ``prefix`` is ``"bert."`` in a task model's checkpoint."""

    tied_head = None  # no language-model head
    fused = None  # no stored weight split at load

    def __init__(self, checkpoint: Checkpoint, task: str, max_length: int) -> None:
        c = checkpoint
        self.task = task
        self.prefix = "bert." if c.architecture != "BertModel" else ""
        self.width = c.dimension("hidden_size")
        self.heads = c.dimension("num_attention_heads")
        self.layers = c.blocks("num_hidden_layers")
        self.inner = c.dimension("intermediate_size")
        self.context = c.dimension("max_position_embeddings")
        self.vocabulary = c.dimension("vocab_size")
        self.token_types = c.dimension("type_vocab_size", 2)
        self.eps = c.number("layer_norm_eps", 1e-12)
        self.activation = ACTIVATIONS[c.choice("hidden_act", "gelu", ACTIVATIONS)]
        c.choice("position_embedding_type", "absolute", ["absolute"])
        if self.width % self.heads:
            raise c.unsupported("num_attention_heads", self.heads, f"it must divide hidden_size ({self.width})")
        self.scale = 1 / math.sqrt(self.width // self.heads)
        labels = c.field("id2label", None, dict) or {}
        self.labels = [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(len(labels))] \
            if task == "classification" else []
        if task == "classification" and not self.labels:
            raise c.unsupported("id2label", labels, "a classifier needs the names of its labels")
        self.multi_label = c.field("problem_type", None) == "multi_label_classification" or len(self.labels) == 1

    def weights(self) -> dict[str, tuple[int, ...]]:
        d, inner, p = self.width, self.inner, self.prefix
        expected = {f"{p}embeddings.word_embeddings.weight": (self.vocabulary, d),
                    f"{p}embeddings.position_embeddings.weight": (self.context, d),
                    f"{p}embeddings.token_type_embeddings.weight": (self.token_types, d),
                    f"{p}embeddings.LayerNorm.weight": (d,), f"{p}embeddings.LayerNorm.bias": (d,)}
        linears = {"attention.self.query": (d, d), "attention.self.key": (d, d), "attention.self.value": (d, d),
                   "attention.output.dense": (d, d), "intermediate.dense": (inner, d), "output.dense": (d, inner)}
        for i in range(self.layers):
            layer = f"{p}encoder.layer.{i}."
            for name, shape in linears.items():
                expected[f"{layer}{name}.weight"] = shape
                expected[f"{layer}{name}.bias"] = shape[:1]
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                expected.update({f"{layer}{norm}.weight": (d,), f"{layer}{norm}.bias": (d,)})
        if self.task == "classification":
            expected.update({f"{p}pooler.dense.weight": (d, d), f"{p}pooler.dense.bias": (d,),
                             "classifier.weight": (len(self.labels), d), "classifier.bias": (len(self.labels),)})
        return expected

    def ignored(self) -> list[str]:
        """The position ids buffer older checkpoints saved; for an embedding, the pooler and a classifier,
        which it does not use."""
        return [r"(bert\.)?embeddings\.position_ids",
                *([r"(bert\.)?pooler\.dense\.(weight|bias)", r"classifier\.(weight|bias)"]
                  if self.task == "embedding" else [])]

    def encode(self, params: Any, ids: Any, mask: Any, types: Any) -> Any:
        """The last layer's hidden states (B, S, D) of token ids, attention masks and token types (B, S)."""
        bert = params["bert"] if self.prefix else params
        e = bert["embeddings"]
        x = e["word_embeddings"]["weight"][ids] + e["position_embeddings"]["weight"][:ids.shape[1]] \
            + e["token_type_embeddings"]["weight"][types]
        x = layer_norm(x, e["LayerNorm"], self.eps)
        visible = (mask > 0)[:, None, None, :]
        for layer in bert["encoder"]["layer"]:
            x = jax.vmap(lambda row, seen, layer=layer: self._layer(layer, row, seen))(x, visible)
        return x

    def _layer(self, p: Any, x: Any, visible: Any) -> Any:
        attention = p["attention"]
        q, k, v = (split_heads(linear(x, attention["self"][name]), self.heads) for name in ("query", "key", "value"))
        scores = jnp.einsum("hsd,htd->hst", q, k).astype(jnp.float32) * self.scale
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        mixed = merge_heads(jnp.einsum("hst,htd->hsd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v))
        x = layer_norm(x + linear(mixed, attention["output"]["dense"]), attention["output"]["LayerNorm"], self.eps)
        inner = self.activation(linear(x, p["intermediate"]["dense"]))
        return layer_norm(x + linear(inner, p["output"]["dense"]), p["output"]["LayerNorm"], self.eps)

    def classify(self, params: Any, x: Any) -> Any:
        """The classifier's logits (B, labels), float32, from the hidden states."""
        pooled = jnp.tanh(linear(x[:, 0], params["bert"]["pooler"]["dense"]))
        return linear(pooled, params["classifier"]).astype(jnp.float32)

    @staticmethod
    def pool(x: Any, mask: Any, pooling: str, normalize: bool) -> Any:
        """One vector per text (B, D), float32, pooled over the masked positions as ``POOLINGS[pooling]``."""
        vectors = POOLINGS[pooling](x.astype(jnp.float32), (mask > 0).astype(jnp.float32)[:, :, None])
        if normalize:
            vectors = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return vectors
