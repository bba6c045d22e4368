"""``from_pretrained``: a local Hugging Face checkpoint folder as what ``js.serve`` and ``jitserve serve``
take. A causal LM becomes a text :class:`~jitserve.Generation` (its tokenizer in and out, eos from the
checkpoint), a BERT classifier or encoder a text :class:`~jitserve.Serving` (labels and probabilities,
or one vector per text). The checkpoint is checked (config fields, then every weight's name and shape)
before anything compiles; everything the model needs comes from ``config.json``. The served model's
``preprocess`` is a :class:`TextHook`: a front reads the tokenizer and the task from it (:func:`text_hook`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..batch import Batch
from ..defn import resolve_options
from ..errors import CheckpointError, ModelError, OptionError
from ..serving.generation import Generation, PagedCache, Sampling
from ..serving.options import powers_of_two_up_to
from ..serving.serving import Serving
from ..template import template
from . import layers
from .bert import POOLINGS, Bert
from .checkpoint import Checkpoint, check_dtype
from .gpt2 import GPT2
from .llama import Llama
from .sentence import Sentence, sentence_folder
from .sharding import mesh_of, tensor_parallel
from .tokenizer import Tokenizer

PAGED_OPTIONS = ("kv_cache_tokens", "block_size", "prefix_caching")  # what only a paged cache takes
GENERATION_OPTIONS = {"slots", "kv_cache", "prefill_lengths", "steps_per_launch", *PAGED_OPTIONS}
KV_CACHES = ("paged", "slots")  # a generation's KV cache: blocks of a pool (the default), or a row per slot
DEFAULT_MAX_LENGTH = 2048  # a generation's default room per sequence, where the context is longer
SHORTEST_BUCKET = 16  # the shortest compiled prompt or text length
SAMPLED_DEFAULTS = ("temperature", "top_k", "top_p", "min_p")  # generation_config.json's, where do_sample is true

# architecture -> (the config.json 'model_type' it is built for; its family, built from (checkpoint, task,
# max_length); the config field of its context length; its tasks, the default first)
ARCHITECTURES: dict[str, tuple[str, Callable[..., Any], str, tuple[str, ...]]] = {
    "GPT2LMHeadModel": ("gpt2", GPT2, "n_positions", ("generation",)),
    "LlamaForCausalLM": ("llama", Llama, "max_position_embeddings", ("generation",)),
    "MistralForCausalLM": ("mistral", Llama, "max_position_embeddings", ("generation",)),
    "Qwen2ForCausalLM": ("qwen2", Llama, "max_position_embeddings", ("generation",)),
    "Qwen3ForCausalLM": ("qwen3", Llama, "max_position_embeddings", ("generation",)),
    "Phi3ForCausalLM": ("phi3", Llama, "max_position_embeddings", ("generation",)),
    "BertForSequenceClassification": ("bert", Bert, "max_position_embeddings", ("classification", "embedding")),
    "BertModel": ("bert", Bert, "max_position_embeddings", ("embedding",)),
}


class TextHook:
    """The ``preprocess`` of a checkpoint's served model, which reads text: ``read(value)``, with the
    ``tokenizer`` it reads with, the ``task`` the model does and its ``vocabulary`` (the embedding's rows:
    the token ids it reads, 0 to ``vocabulary - 1``, at least the tokenizer's), for the fronts that need more
    than the model's tensors (the OpenAI door renders chats and counts tokens with them: ``protocol/openai.py``)."""

    def __init__(self, read: Callable[[Any], Any], tokenizer: Tokenizer, task: str, vocabulary: int) -> None:
        self.read = read
        self.tokenizer = tokenizer
        self.task = task
        self.vocabulary = vocabulary

    def __call__(self, value: Any) -> Any:
        return self.read(value)


def text_hook(servable: Any) -> TextHook | None:
    """The :class:`TextHook` of a ``Generation`` or ``Serving`` that ``from_pretrained`` made, else None."""
    hook = getattr(servable, "preprocess", None)
    return hook if isinstance(hook, TextHook) else None


def from_pretrained(path: str | os.PathLike[str], *, task: str | None = None, dtype: str | None = None,
                    max_length: int | None = None, compiler: str | None = None, devices: Any = None,
                    **options: Any) -> Generation | Serving:
    """The checkpoint folder ``path`` as a served model (see the module). ``task``: ``generation``,
    ``classification`` or ``embedding`` (default: the architecture's own); ``dtype``: ``float32``,
    ``bfloat16`` or ``float16`` (default: as stored); ``max_length``: a generation's tokens per sequence
    (default: the context, at most 2,048), a text's tokens for the encoders (default: the context);
    ``options``: the serving's (``slots``, ``batch_size``, ``prefill_lengths``, ...; for a generation also
    ``kv_cache="paged"`` (blocks of ``block_size=16`` positions from a pool of ``kv_cache_tokens``, by default
    eight sequences' ``max_length``, ``prefix_caching=True``; ``slots``, 32 by default, is then the most
    sequences a step runs) or ``"slots"`` (a ``max_length`` row per slot, 8 by default); for an embedding
    also ``pooling`` (``"mean"``, ``"cls"``, or another mode of :data:`~.bert.POOLINGS`) and ``normalize``, by
    default what a sentence-transformers folder says (:mod:`~.sentence`, whose texts are then cut to
    ``max_length``, by default its ``max_seq_length``), else the mean, unnormalised); ``devices``: a
    generation's number of devices, or a ``jax.sharding.Mesh``, to split its weights and KV cache over (tensor
    parallel, :mod:`~jitserve.models.sharding`, with the slot cache; None or 1: one device). Raises
    :class:`CheckpointError` naming the field or weight that does not fit."""
    mesh = mesh_of(devices)
    checkpoint = Checkpoint(path)
    architecture = checkpoint.architecture
    family, context_field, tasks = _served(checkpoint)
    task = tasks[0] if task is None else task
    if task not in tasks:
        raise OptionError(f"task {task!r} is not one {architecture} can do; it does {', '.join(tasks)}")
    if mesh is not None and task != "generation":
        raise OptionError(f"devices={devices!r}: tensor parallel splits a generation (a causal LM); {architecture} "
                          f"as {task!r} runs on one device (leave devices out; partitions=N serves copies on N)")
    context = checkpoint.count(context_field)
    sentence = sentence_folder(checkpoint, context) if task == "embedding" else None
    if max_length is None:
        max_length = min(context, DEFAULT_MAX_LENGTH) if task == "generation" else \
            context if sentence is None else sentence.length
    elif isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= context:
        raise CheckpointError(f"checkpoint {checkpoint.folder!r}: max_length={max_length!r} must be a positive "
                              f"integer at most the model's context, config.json's {context_field!r} ({context})")
    dtype = check_dtype(dtype)
    model = family(checkpoint, task, max_length)
    params = checkpoint.weights(model.weights(), model.ignored(), dtype, model.tied_head, model.fused)
    tokenizer = Tokenizer(checkpoint)
    _check_vocabulary(checkpoint, tokenizer, model.vocabulary)
    options = {**({"compiler": compiler} if compiler else {}), **options}
    generating = sorted(set(options) & GENERATION_OPTIONS)
    if task != "generation" and generating:
        raise OptionError(f"{', '.join(generating)} apply to a generation; {architecture} is served as {task!r}")
    if task == "generation":
        if mesh is not None:
            options["mesh"] = tensor_parallel(model, mesh, params, checkpoint.folder)
        return _generation(checkpoint, model, params, tokenizer, max_length, options)
    if sentence is not None:
        sentence.apply(checkpoint.folder, tokenizer, max_length, model.width)
    return _encoder(model, params, tokenizer, task, max_length, options, sentence)


def _served(checkpoint: Checkpoint) -> tuple[Callable[..., Any], str, tuple[str, ...]]:
    """The family, context field and tasks of the checkpoint's architecture, once its ``model_type`` is the
    one the architecture is built for (``transformers`` builds the model ``model_type`` names, whatever
    ``architectures`` says) and its weights are not quantized."""
    folder, config = checkpoint.folder, checkpoint.config
    if checkpoint.architecture not in ARCHITECTURES:
        raise CheckpointError(f"checkpoint {folder!r}: config.json's 'architectures' is "
                              f"{config.get('architectures')!r}; jitserve serves {', '.join(ARCHITECTURES)}")
    model_type, family, context_field, tasks = ARCHITECTURES[checkpoint.architecture]
    if config.get("model_type", model_type) != model_type:
        raise CheckpointError(f"checkpoint {folder!r}: config.json's 'model_type' is {config['model_type']!r}, "
                              f"but its 'architectures' says {checkpoint.architecture}, which is a {model_type!r} "
                              f"model; transformers builds a {config['model_type']!r} model from this folder, so "
                              f"jitserve does not run {checkpoint.architecture}'s arithmetic on its weights")
    quantization = config.get("quantization_config")
    if quantization is not None:
        said = quantization if isinstance(quantization, dict) else {}
        how = ", ".join(f"{key} {said[key]!r}" for key in ("quant_method", "format") if key in said)
        raise CheckpointError(f"checkpoint {folder!r} is quantized (config.json's 'quantization_config': "
                              f"{how or repr(quantization)}); jitserve serves float32, bfloat16 and float16 "
                              f"weights, not quantized ones, for now")
    return family, context_field, tasks


def _check_vocabulary(checkpoint: Checkpoint, tokenizer: Tokenizer, rows: int) -> None:
    """The tokenizer's ids all have a row of the embedding (``rows`` of them; a padded embedding has more)."""
    ids = max(tokenizer.rust.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if ids > rows:
        raise CheckpointError(f"checkpoint {checkpoint.folder!r}: tokenizer.json has token ids up to {ids - 1}, but "
                              f"the embedding has {rows} rows (config.json's 'vocab_size'); an id past it would "
                              f"read no row of the model's")


def _generation(checkpoint: Checkpoint, model: Any, params: Any, tokenizer: Tokenizer, max_length: int,
                options: dict[str, Any]) -> Generation:
    def prompt_ids(prompt: Any) -> np.ndarray:
        if isinstance(prompt, np.ndarray) and prompt.dtype.kind == "O" and prompt.size == 1:
            prompt = prompt.reshape(-1)[0]
        if isinstance(prompt, np.ndarray):  # a tensor of another datatype, or of several texts or none
            got = f"{prompt.size} texts" if prompt.dtype.kind in "OSU" else f"{prompt.dtype} values shaped " \
                  f"{list(prompt.shape)}"
            raise ModelError(f"a prompt is one text (str, or UTF-8 bytes; over the network a BYTES tensor of one "
                             f"element); got {got}")
        if not isinstance(prompt, str | bytes):
            raise ModelError(f"a prompt is one text (str, or UTF-8 bytes); got {type(prompt).__name__}")
        return tokenizer.encode(prompt)

    chosen, _ = resolve_options({key: options[key] for key in ("compiler",) if key in options})
    # the paged cache where it runs: on one device, with a compiler that pages as XLA does (not IREE)
    chose = "kv_cache" in options
    kv_cache = options.pop("kv_cache", "paged" if chosen.pages and "mesh" not in options else "slots")
    if kv_cache not in KV_CACHES:
        raise OptionError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    common = {"params": params, "max_length": max_length, "eos": _eos(checkpoint, tokenizer), "logits": True,
              "default_sampling": default_sampling(checkpoint),
              "preprocess": TextHook(prompt_ids, tokenizer, "generation", model.vocabulary),
              "detokenizer": tokenizer.stream}
    if kv_cache == "slots":
        paged_only = [name for name in PAGED_OPTIONS if name in options]
        if paged_only:
            why = "" if chose else ", as its compiler or devices ask"
            raise OptionError(f"{', '.join(paged_only)} size a paged cache; this generation keeps a slot cache "
                              f"(kv_cache='slots'{why})")
        options.setdefault("slots", 8)
        return Generation(functools.partial(layers.prefill, model, max_length),
                          functools.partial(layers.decode, model), **common, **options)
    block_size = options.pop("block_size", 16)
    cache = PagedCache(layers=model.layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
                       dtype=jax.tree_util.tree_leaves(params)[0].dtype, block_size=block_size,
                       tokens=options.pop("kv_cache_tokens", None),
                       prefix_caching=options.pop("prefix_caching", True))
    options.setdefault("slots", 32)
    return Generation(forward=functools.partial(layers.paged_forward, model, cache.block_size), cache=cache,
                      **common, **options)


def default_sampling(checkpoint: Checkpoint) -> dict[str, Any]:
    """The sampling a request gets where it gives none of its own, from ``generation_config.json`` as
    ``transformers``' ``generate()`` reads it: its ``repetition_penalty``; and where ``do_sample`` is true,
    its ``temperature`` (1 where unsaid) and the cuts it states (``top_k``, ``top_p``, ``min_p``). Without
    ``do_sample`` the sampling fields are not defaults, as ``generate()`` ignores them when greedy; a cut
    the file does not state is none (as vLLM: not ``generate()``'s implicit ``top_k`` of 50)."""
    config = checkpoint.json("generation_config.json") or {}
    sampled = config.get("do_sample") is True
    chosen = {name: config[name] for name in ("repetition_penalty", *(SAMPLED_DEFAULTS if sampled else ()))
              if config.get(name) is not None}
    if sampled:
        chosen.setdefault("temperature", 1.0)
    for name, value in chosen.items():
        try:
            Sampling(**{name: value})
        except OptionError as error:
            raise CheckpointError(f"checkpoint {checkpoint.folder!r}: generation_config.json's {name!r}: "
                                  f"{error}") from None
    return chosen


def _eos(checkpoint: Checkpoint, tokenizer: Tokenizer) -> list[int] | None:
    """The ids that end a sequence: generation_config.json's ``eos_token_id`` (one or a list), else
    config.json's, else the tokenizer's end token."""
    found = (checkpoint.json("generation_config.json") or {}).get("eos_token_id")
    if found is None:
        found = checkpoint.config.get("eos_token_id")
    if found is None:
        return None if tokenizer.eos is None else [tokenizer.eos]
    ids = found if isinstance(found, list) else [found]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"checkpoint {checkpoint.folder!r}: eos_token_id is {found!r}; expected a token id "
                              f"or a list of them")
    return ids


def _encoder(model: Bert, params: Any, tokenizer: Tokenizer, task: str, max_length: int,
             options: dict[str, Any], sentence: Sentence | None) -> Serving:
    """A text serving of ``model``: labels and probabilities, or one vector per text, pooled and normalised
    as the options say, else as a sentence-transformers folder says (``sentence``, whose texts are cut to
    ``max_length`` tokens; others' longer texts are refused), else the mean, unnormalised."""
    pooling, normalize = ("mean", False) if sentence is None else (sentence.pooling, sentence.normalize)
    pooling = options.pop("pooling", pooling) if task == "embedding" else pooling
    normalize = bool(options.pop("normalize", normalize)) if task == "embedding" else normalize
    if pooling not in POOLINGS:
        raise OptionError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    buckets = powers_of_two_up_to(max_length, SHORTEST_BUCKET)

    def run(params: Any, length: int, batch: dict[str, Any]) -> dict[str, Any]:
        ids, mask, types = (batch[name][:, :length] for name in ("input_ids", "attention_mask", "token_type_ids"))
        hidden = model.encode(params, ids, mask, types)
        if task == "classification":
            return {"logits": model.classify(params, hidden)}
        return {"embedding": Bert.pool(hidden, mask, pooling, normalize)}

    pad = tokenizer.pad or 0

    def preprocess(texts: Any) -> Batch:
        texts = [texts] if isinstance(texts, str | bytes) else list(np.asarray(texts, dtype=object).reshape(-1))
        if not texts:
            raise ModelError("send at least one text")
        encoded = tokenizer.encode_many(texts)
        longest = max(len(ids) for ids, _ in encoded)
        if longest > max_length:
            at = next(i for i, (ids, _) in enumerate(encoded) if len(ids) == longest)
            raise ModelError(f"text {at} is {longest} tokens long; this model reads at most {max_length}")
        arrays = {name: np.full((len(texts), max_length), fill, np.int32)
                  for name, fill in (("input_ids", pad), ("attention_mask", 0), ("token_type_ids", 0))}
        for row, (ids, types) in enumerate(encoded):
            arrays["input_ids"][row, :len(ids)] = ids
            arrays["attention_mask"][row, :len(ids)] = 1
            arrays["token_type_ids"][row, :len(ids)] = types
        return Batch.concatenate([arrays]).key(next(n for n in buckets if n >= longest))

    def postprocess(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if task == "embedding":
            return outputs
        logits = np.asarray(outputs["logits"], np.float64)
        if model.multi_label:
            probabilities = 1 / (1 + np.exp(-logits))
        else:
            shifted = np.exp(logits - logits.max(-1, keepdims=True))
            probabilities = shifted / shifted.sum(-1, keepdims=True)
        labels = np.array([model.labels[i].encode() for i in probabilities.argmax(-1)], dtype=object)
        return {"label": labels, "probabilities": probabilities.astype(np.float32)}

    row = template((max_length,), "int32")
    outputs = {"label": ("BYTES", ()), "probabilities": ("FP32", (len(model.labels),))} \
        if task == "classification" else {"embedding": ("FP32", (model.width,))}
    options = {"batch_size": 8, "batch_timeout": 0.002, **options}
    if task == "classification":  # Triton's classification extension names each class by its label
        options.setdefault("labels", {"probabilities": model.labels})
    return Serving(run, params=params, batch_keys=buckets,
                   preprocess=TextHook(preprocess, tokenizer, task, model.vocabulary), postprocess=postprocess,
                   input_template={"input_ids": row, "attention_mask": row, "token_type_ids": row},
                   wire={"inputs": {"text": ("BYTES", ())}, "outputs": outputs}, **options)

