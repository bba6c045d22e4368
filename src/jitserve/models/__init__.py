"""Hugging Face checkpoints served as they are: :func:`from_pretrained` reads a local folder, checks it,
and gives a :class:`~jitserve.Generation` or :class:`~jitserve.Serving` over one of the families here
(GPT-2, Llama / Mistral / Qwen2 / Qwen3, BERT), with the checkpoint's own tokenizer."""

from .pretrained import ARCHITECTURES, from_pretrained
from .tokenizer import TextStream, Tokenizer

__all__ = ["ARCHITECTURES", "TextStream", "Tokenizer", "from_pretrained"]
