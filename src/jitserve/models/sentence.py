"""sentence-transformers folders (a ``modules.json`` beside ``config.json``) read into how ``from_pretrained``
embeds, as the ``sentence-transformers`` package's ``encode`` does: the Pooling module's mode
(``1_Pooling/config.json``, either format), a ``Normalize`` module's L2 normalisation, and the tokens a text
is cut to (``sentence_bert_config.json``'s ``max_seq_length``, else the tokenizer's ``model_max_length``
within the model's context), lower-cased first where ``do_lower_case`` says so. Any other module (``Dense``,
...), several pooling modes at once, or a default prompt is refused by name."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .bert import POOLINGS
from .checkpoint import Checkpoint
from .tokenizer import Tokenizer

# 1_Pooling/config.json's flags before sentence-transformers 5 (which writes one 'pooling_mode') -> the mode
LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
PIPELINES = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])  # the modules served, in order


@dataclass(frozen=True)
class Sentence:
    """How a sentence-transformers folder embeds: ``pooling`` (a key of ``POOLINGS``), ``normalize``, the
    ``length`` a text's tokens are cut to, ``lowercase`` the text first, and the pooled ``width`` it says."""

    pooling: str
    normalize: bool
    length: int
    lowercase: bool
    width: int | None

    def apply(self, folder: str, tokenizer: Tokenizer, length: int, width: int) -> None:
        """Make ``tokenizer`` (this model's own) cut texts to ``length`` tokens, special ones included, as
        ``transformers`` does for ``encode`` (``truncation=True``), lower-casing them first if asked, once the
        pooled width is the model's ``width``."""
        from tokenizers import normalizers

        if self.width not in (None, width):
            raise CheckpointError(f"checkpoint {folder!r}: the Pooling module's embedding dimension is "
                                  f"{self.width}, but the model's hidden states are {width} wide")
        if self.lowercase:
            kept = [] if tokenizer.rust.normalizer is None else [tokenizer.rust.normalizer]
            tokenizer.rust.normalizer = normalizers.Sequence([normalizers.Lowercase(), *kept])
        tokenizer.rust.enable_truncation(length)


def sentence_folder(checkpoint: Checkpoint, context: int) -> Sentence | None:
    """The folder's :class:`Sentence`, or None where it has no ``modules.json``; ``context``: the model's."""
    modules = checkpoint.json("modules.json", list)
    if modules is None:
        return None
    folder = checkpoint.folder
    kinds = [str(module.get("type", "")) if isinstance(module, dict) else repr(module) for module in modules]
    if [kind.rsplit(".", 1)[-1] for kind in kinds] not in PIPELINES or not all(
            kind.startswith("sentence_transformers.") for kind in kinds):
        raise CheckpointError(f"checkpoint {folder!r}: modules.json lists {', '.join(kinds) or 'no modules'}; "
                              f"jitserve serves a sentence-transformers Transformer, its Pooling and optionally "
                              f"Normalize, in that order")
    transformer, pooling = modules[0].get("path", ""), modules[1].get("path")
    if transformer != "" or not isinstance(pooling, str) or pooling in ("", ".", "..") \
            or os.path.basename(pooling) != pooling:
        raise CheckpointError(f"checkpoint {folder!r}: modules.json puts the Transformer at {transformer!r} and the "
                              f"Pooling at {pooling!r}; jitserve reads the Transformer from the folder itself and "
                              f"the Pooling from a folder in it")
    settings = checkpoint.json(os.path.join(pooling, "config.json")) or {}
    prompt = (checkpoint.json("config_sentence_transformers.json") or {}).get("default_prompt_name")
    if prompt is not None:
        raise CheckpointError(f"checkpoint {folder!r}: config_sentence_transformers.json's 'default_prompt_name' "
                              f"is {prompt!r}; jitserve does not put a prompt before the texts it embeds")
    config = checkpoint.json("sentence_bert_config.json") or {}
    return Sentence(_mode(folder, pooling, settings), len(modules) == 3, _length(checkpoint, config, context),
                    config.get("do_lower_case") is True,
                    settings.get("embedding_dimension", settings.get("word_embedding_dimension")))


def _mode(folder: str, path: str, settings: dict[str, Any]) -> str:
    """The one pooling mode of a Pooling module's config."""
    mode = settings.get("pooling_mode", [mode for key, mode in LEGACY_MODES.items() if settings.get(key) is True])
    modes = mode if isinstance(mode, list) else [mode]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise CheckpointError(f"checkpoint {folder!r}: {path}/config.json pools by {modes!r}; jitserve pools by one "
                              f"mode of {', '.join(POOLINGS)}")
    return str(modes[0])


def _length(checkpoint: Checkpoint, config: dict[str, Any], context: int) -> int:
    """The tokens a text is cut to: ``max_seq_length``, else the tokenizer's ``model_max_length``, at most the
    model's context (as sentence-transformers caps the latter; a larger ``max_seq_length`` is refused)."""
    length = config.get("max_seq_length")
    if length is None:
        said = (checkpoint.json("tokenizer_config.json") or {}).get("model_max_length")
        return min(said, context) if isinstance(said, int) and not isinstance(said, bool) and said > 0 else context
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= context:
        raise CheckpointError(f"checkpoint {checkpoint.folder!r}: sentence_bert_config.json's 'max_seq_length' is "
                              f"{length!r}; expected a positive integer at most the model's context ({context})")
    return length
