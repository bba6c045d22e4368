"""A text generation for the Ray tests: its tokenizer and detokenizer live in this module, which (as
ray_models) the replicas cannot import: it travels to them by value."""

import numpy as np
import ray_models

import jitserve as js


def encode(text):
    """A byte-level tokenizer: each UTF-8 byte of one string one token id."""
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32)


def piece(token):
    """A token's text: one printable ASCII byte."""
    return bytes([32 + int(token) % 95])


def generation() -> js.Generation:
    base = ray_models.generation(slots=2)
    return js.Generation(base.prefill, base.decode, params=base.params, slots=2, max_length=64, prefill_lengths=[8],
                         logits=True, preprocess=encode, postprocess=piece)
