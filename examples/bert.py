"""A BERT-style encoder classifier in plain ``jax.numpy``: text in, a label and probabilities out.

The weights carry the names Hugging Face's ``BertForSequenceClassification``
gives them (``bert.encoder.layer.0.attention.self.query.weight``, ...), so the
same ``.safetensors`` file loads into both; ``tests/examples`` checks the two
against each other. Nothing is downloaded: the weights are made from a fixed
seed and saved under ``examples/weights/`` on first use, and the tokenizer is
byte-level (every UTF-8 byte one token), built here.

    jitserve serve examples/bert.py:serving     # model "bert": BYTES "text" in, BYTES "label" out

``preprocess`` tokenizes the texts (a list of str or bytes in process; a BYTES
tensor over the network) into ids padded to ``SEQUENCE`` and an attention
mask; ``postprocess`` turns the logits into labels and probabilities. Set
``JITSERVE_BERT=full`` for BERT-base's size (110 M parameters, 440 MB).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js
from jitserve.params import save_params

PAD, CLS, SEP, FIRST_BYTE = 0, 1, 2, 3  # the byte-level vocabulary: 3 special tokens, then the 256 bytes
CONFIGS = {
    "small": {"vocab_size": 259, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "max_position_embeddings": 128, "type_vocab_size": 2},
    "full": {"vocab_size": 259, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2},
}
SIZE = os.environ.get("JITSERVE_BERT", "small")
CONFIG = CONFIGS[SIZE]
LABELS = ("negative", "positive")
SEQUENCE = 64  # tokens per text, [CLS] and [SEP] included; longer texts are cut
WEIGHTS = Path(__file__).resolve().parent / "weights" / f"bert-{SIZE}.safetensors"
LAYER_NORM_EPS = 1e-12


def init_params(config: dict, seed: int = 0) -> dict:
    """The classifier's parameters, random from ``seed`` (std 0.02; biases and layer norms random too)."""
    rng = np.random.default_rng(seed)
    d, inner = config["hidden_size"], config["intermediate_size"]

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape, np.float32) * np.float32(std)).astype(np.float32)

    def norm():
        return {"weight": 1 + normal(d, std=0.1), "bias": normal(d)}

    def linear(n_in, n_out):  # torch's Linear: weight (out, in)
        return {"weight": normal(n_out, n_in), "bias": normal(n_out)}

    layers = [{"attention": {"self": {"query": linear(d, d), "key": linear(d, d), "value": linear(d, d)},
                             "output": {"dense": linear(d, d), "LayerNorm": norm()}},
               "intermediate": {"dense": linear(d, inner)},
               "output": {"dense": linear(inner, d), "LayerNorm": norm()}} for _ in range(config["num_hidden_layers"])]
    embeddings = {"word_embeddings": {"weight": normal(config["vocab_size"], d)},
                  "position_embeddings": {"weight": normal(config["max_position_embeddings"], d)},
                  "token_type_embeddings": {"weight": normal(config["type_vocab_size"], d)}, "LayerNorm": norm()}
    return {"bert": {"embeddings": embeddings, "encoder": {"layer": layers}, "pooler": {"dense": linear(d, d)}},
            "classifier": linear(d, len(LABELS))}


def load(config: dict = CONFIG, path: Path = WEIGHTS) -> dict:
    """The weights from ``path``, made and saved there first if it does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_params(path, init_params(config))
    return js.load_params(path)


def tokenize(texts: Any, sequence: int = SEQUENCE) -> dict[str, np.ndarray]:
    """Byte-level token ids ``[CLS] bytes... [SEP]`` padded to ``sequence``, and the attention mask."""
    ids = np.zeros((len(texts), sequence), np.int32)
    for row, text in enumerate(texts):
        data = (text.encode() if isinstance(text, str) else bytes(text))[:sequence - 2]
        ids[row, :len(data) + 2] = [CLS, *(FIRST_BYTE + np.frombuffer(data, np.uint8)), SEP]
    return {"input_ids": ids, "attention_mask": (ids != PAD).astype(np.int32)}


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(variance + LAYER_NORM_EPS) * p["weight"] + p["bias"]


def dense(x, p):
    return x @ p["weight"].T + p["bias"]


def heads(x, n_head):
    """(B, S, D) -> (B, H, S, D / H)."""
    b, s, d = x.shape
    return x.reshape(b, s, n_head, d // n_head).transpose(0, 2, 1, 3)


def encoder_layer(p, x, key_mask, n_head):
    attention = p["attention"]
    q, k, v = (heads(dense(x, attention["self"][name]), n_head) for name in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
    mixed = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(x.shape)
    x = layer_norm(x + dense(mixed, attention["output"]["dense"]), attention["output"]["LayerNorm"])
    inner = jax.nn.gelu(dense(x, p["intermediate"]["dense"]), approximate=False)
    return layer_norm(x + dense(inner, p["output"]["dense"]), p["output"]["LayerNorm"])


def classify(params, entry, n_head=CONFIG["num_attention_heads"]):
    """The served function: token ids and attention masks (batch, sequence) -> logits (batch, labels)."""
    bert = params["bert"]
    embeddings = bert["embeddings"]
    ids = entry["input_ids"]
    x = (embeddings["word_embeddings"]["weight"][ids] + embeddings["position_embeddings"]["weight"][:ids.shape[1]]
         + embeddings["token_type_embeddings"]["weight"][0])
    x = layer_norm(x, embeddings["LayerNorm"])
    for layer in bert["encoder"]["layer"]:
        x = encoder_layer(layer, x, entry["attention_mask"] > 0, n_head)
    pooled = jnp.tanh(dense(x[:, 0], bert["pooler"]["dense"]))
    return dense(pooled, params["classifier"])


def preprocess(texts: Any) -> js.Batch:
    """Texts (str or bytes; a BYTES tensor of any shape over the network) as a batch of token ids."""
    texts = np.asarray(texts, dtype=object).reshape(-1)
    if texts.size == 0:
        raise js.BatchError("send at least one text")
    return js.Batch.concatenate([tokenize(texts)])


def postprocess(logits: np.ndarray) -> dict[str, np.ndarray]:
    """Logits as each text's label (BYTES over the network) and its probabilities."""
    probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))
    labels = np.array([LABELS[i].encode() for i in probabilities.argmax(-1)], dtype=object)
    return {"label": labels, "probabilities": probabilities}


serving = js.Serving(classify, params=load(), batch_size=8, batch_timeout=0.002, preprocess=preprocess,
                     postprocess=postprocess, input_template={"input_ids": js.template((SEQUENCE,), "int32"),
                                                              "attention_mask": js.template((SEQUENCE,), "int32")})
