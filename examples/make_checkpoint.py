"""Hugging Face checkpoint folders for the examples, made here with numpy, ``tokenizers`` and json only (no
torch, no transformers, nothing downloaded), laid out as ``transformers``' ``save_pretrained`` lays them
out, so that ``js.from_pretrained`` reads them as it reads any checkpoint (and ``transformers`` loads them
too: ``tests/examples`` compares the two):

- ``config.json`` written by hand with the architecture's own fields, as ``transformers`` 5 writes them
  (``architectures``, ``model_type``, ``rope_parameters``, ...);
- ``model.safetensors``: random weights from a fixed seed under the checkpoint's own key names, wider
  than a trained model's so that greedy decoding varies (a narrow random model repeats one token);
- ``tokenizer.json``: a byte-level BPE (GPT-2's and Llama 3's kind) or a WordPiece (BERT's) trained on
  ``TEXT`` below, with ``tokenizer_config.json`` (its special tokens) and ``generation_config.json``.

Each folder is made under ``examples/weights/`` the first time an example asks for it (in about a second;
a full size in up to half a minute, 0.4 to 2.5 GB). The examples import this file as a sibling module:
``jitserve serve examples/X.py:NAME`` puts the example's folder on ``sys.path``, as ``python`` does for a
script (``examples/`` is not a package; a test or bench that loads an example by path does the same)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from jitserve.params import save_params

WEIGHTS = Path(__file__).resolve().parent / "weights"

TEXT = """\
Once upon a time there was a little model that wanted to serve text to everyone who asked.
It read every prompt with care, wrote one token at a time, and never kept anyone waiting long.
A server batches the requests that arrive together, a scheduler admits them into free slots between
steps, and a cache keeps the keys and values of every token it has seen, so each step reads them again.
The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly.
Numbers like 12345 and 2026, symbols such as #@$% and (brackets) appear in real text too.
Café, naïve, façade, jalapeño, straße, 東京, Ελληνικά and ✓ marks: text is not only ASCII.
What a great film, a fine story and a kind ending; what a terrible, slow and boring afternoon.
"""

# the architecture's config.json at each size; "small" is made unless JITSERVE_<FAMILY>=full asks for the
# family's own published size. A vocab_size of None is the tokenizer's (trained on TEXT); a full-size
# vocabulary is larger than TEXT's tokenizer, whose tokens it keeps (ids beyond it decode to nothing)
SIZES = {
    "gpt2": {"small": {"vocab_size": None, "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4},
             "full": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}},
    "llama": {"small": {"vocab_size": None, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
                        "max_position_embeddings": 256, "original_max_position_embeddings": 64},
              "full": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                       "max_position_embeddings": 131072, "original_max_position_embeddings": 8192}},
    "bert": {"small": {"vocab_size": None, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 128, "max_position_embeddings": 128},
             "full": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                      "intermediate_size": 3072, "max_position_embeddings": 512}},
}
VOCABULARY = 512  # the most tokens a tokenizer learns from TEXT
LABELS = ("negative", "positive")  # the BERT classifier's id2label
# a chat template in Llama 3's shape: how chat messages become a prompt, <|begin_of_text|> first (the rendered
# text is encoded without adding special tokens, as transformers' apply_chat_template encodes it)
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                 "<|end_header_id|>\n\n"
                 "{{ message['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def size(family: str) -> str:
    """The size ``JITSERVE_<FAMILY>`` asks for: ``small`` (the default) or ``full``."""
    chosen = os.environ.get(f"JITSERVE_{family.upper()}", "small")
    if chosen not in SIZES[family]:
        raise SystemExit(f"JITSERVE_{family.upper()}={chosen!r}: expected one of {', '.join(SIZES[family])}")
    return chosen


def folder(family: str, make: Callable[[Path, dict], None]) -> Path:
    """``examples/weights/FAMILY-SIZE/``, made by ``make(folder, sizes)`` the first time: into a folder of its
    own, renamed into place when whole, so that a half-made checkpoint is never read."""
    chosen = size(family)
    final = WEIGHTS / f"{family}-{chosen}"
    if not (final / "config.json").is_file():
        partial = WEIGHTS / f".{final.name}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        make(partial, SIZES[family][chosen])
        try:
            partial.rename(final)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(partial)
    return final


def gpt2() -> Path:
    """A ``GPT2LMHeadModel`` checkpoint folder (tied head, byte-level BPE, ``<|endoftext|>`` ends a text)."""
    return folder("gpt2", _gpt2)


def llama() -> Path:
    """A ``LlamaForCausalLM`` checkpoint folder shaped as Llama 3.2 (grouped-query attention, ``llama3`` rope
    scaling, tied head; the full size is Llama 3.2 1B's, in bfloat16), with a chat template."""
    return folder("llama", _llama)


def bert() -> Path:
    """A ``BertForSequenceClassification`` checkpoint folder (WordPiece, lower-cased; labels ``LABELS``)."""
    return folder("bert", _bert)


def _gpt2(path: Path, c: dict) -> None:
    tokenizer = bpe(["<|endoftext|>"])
    end = tokenizer.token_to_id("<|endoftext|>")
    d, vocab = c["n_embd"], c["vocab_size"] or tokenizer.get_vocab_size()
    shapes = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (c["n_positions"], d)}
    for i in range(c["n_layer"]):
        shapes.update({f"transformer.h.{i}.{name}": shape for name, shape in {
            "ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
            "mlp.c_fc.weight": (d, 4 * d), "mlp.c_fc.bias": (4 * d,), "mlp.c_proj.weight": (4 * d, d),
            "mlp.c_proj.bias": (d,)}.items()})
    shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})

    def std(name: str, shape: tuple[int, ...]) -> float:
        # small embeddings and wide blocks (GPT-2's Conv1D weights are (in, out)), so that the blocks and not
        # the tied embedding alone pick the next token
        return 2.4 / np.sqrt(shape[0]) if len(shape) == 2 and ".h." in name else 0.02

    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": c["n_positions"], "n_embd": d, "n_layer": c["n_layer"], "n_head": c["n_head"],
              "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
              "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
              "add_cross_attention": False, "tie_word_embeddings": True, "bos_token_id": end, "eos_token_id": end,
              "dtype": "float32"}
    save(path, config, random_weights(shapes, std, norm_spread=0.1), tokenizer,
         {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "model_max_length": c["n_positions"]},
         {"bos_token_id": end, "eos_token_id": end})


def _llama(path: Path, c: dict) -> None:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer = bpe(specials, bos="<|begin_of_text|>")
    begin, end, turn = (tokenizer.token_to_id(token) for token in (specials[0], specials[1], specials[4]))
    d, inner, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"] or tokenizer.get_vocab_size()
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(c["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in {
            "input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
            "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (inner, d),
            "mlp.up_proj.weight": (inner, d), "mlp.down_proj.weight": (d, inner)}.items()})
    shapes["model.norm.weight"] = (d,)
    full = c["vocab_size"] is not None
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": c["original_max_position_embeddings"]}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d,
              "intermediate_size": inner, "num_hidden_layers": c["num_hidden_layers"],
              "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
              "head_dim": c["head_dim"], "hidden_act": "silu", "max_position_embeddings": c["max_position_embeddings"],
              "rms_norm_eps": 1e-05, "rope_parameters": rope, "attention_bias": False, "attention_dropout": 0.0,
              "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02, "tie_word_embeddings": True,
              "bos_token_id": begin, "eos_token_id": [end, turn], "dtype": "bfloat16" if full else "float32"}
    # wide (std 2 / sqrt(fan in): a Linear's weight is (out, in)), so that greedy decoding varies; the full
    # size in bfloat16, as Llama 3.2 1B is published (2.5 GB, not 5)
    weights = random_weights(shapes, lambda name, shape: 2 / np.sqrt(shape[-1]), norm_spread=0.05,
                             dtype=ml_dtypes.bfloat16 if full else np.float32)
    save(path, config, weights, tokenizer,
         {"bos_token": specials[0], "eos_token": specials[1], "model_max_length": c["max_position_embeddings"],
          "chat_template": CHAT_TEMPLATE}, {"bos_token_id": begin, "eos_token_id": [end, turn]})


def _bert(path: Path, c: dict) -> None:
    tokenizer = wordpiece()
    d, inner, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"] or tokenizer.get_vocab_size()
    shapes = {"bert.embeddings.word_embeddings.weight": (vocab, d),
              "bert.embeddings.position_embeddings.weight": (c["max_position_embeddings"], d),
              "bert.embeddings.token_type_embeddings.weight": (2, d),
              "bert.embeddings.LayerNorm.weight": (d,), "bert.embeddings.LayerNorm.bias": (d,)}
    for i in range(c["num_hidden_layers"]):
        for name, (n_out, n_in) in {"attention.self.query": (d, d), "attention.self.key": (d, d),
                                    "attention.self.value": (d, d), "attention.output.dense": (d, d),
                                    "intermediate.dense": (inner, d), "output.dense": (d, inner)}.items():
            shapes.update({f"bert.encoder.layer.{i}.{name}.weight": (n_out, n_in),
                           f"bert.encoder.layer.{i}.{name}.bias": (n_out,)})
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes.update({f"bert.encoder.layer.{i}.{norm}.weight": (d,), f"bert.encoder.layer.{i}.{norm}.bias": (d,)})
    shapes.update({"bert.pooler.dense.weight": (d, d), "bert.pooler.dense.bias": (d,),
                   "classifier.weight": (len(LABELS), d), "classifier.bias": (len(LABELS),)})
    config = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "vocab_size": vocab,
              "hidden_size": d, "num_hidden_layers": c["num_hidden_layers"],
              "num_attention_heads": c["num_attention_heads"], "intermediate_size": inner, "hidden_act": "gelu",
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
              "max_position_embeddings": c["max_position_embeddings"], "type_vocab_size": 2,
              "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": tokenizer.token_to_id("[PAD]"),
              "position_embedding_type": "absolute", "classifier_dropout": None,
              "id2label": dict(enumerate(LABELS)), "label2id": {label: i for i, label in enumerate(LABELS)},
              "dtype": "float32"}
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}
    save(path, config, random_weights(shapes, lambda name, shape: 0.8 / np.sqrt(shape[-1]), norm_spread=0.02),
         tokenizer, {**specials, "do_lower_case": True, "model_max_length": c["max_position_embeddings"]})


def bpe(specials: list[str], bos: str | None = None) -> Tokenizer:
    """A byte-level BPE trained on ``TEXT`` (every byte a token, then the merges it learns), its special
    tokens first; with ``bos``, encoding puts that token first, as Llama 3's tokenizer does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=VOCABULARY, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def wordpiece() -> Tokenizer:
    """A WordPiece as BERT's, trained on ``TEXT``: lower-cased, accents stripped, ``[CLS] text [SEP]``."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(TEXT.splitlines(), trainers.WordPieceTrainer(
        vocab_size=VOCABULARY, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def random_weights(shapes: dict[str, tuple[int, ...]], std: Callable[[str, tuple[int, ...]], float],
                   norm_spread: float, dtype: type = np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights of ``dtype``, each normal from one generator seeded ``seed``: a norm's weight around 1 (std
    ``norm_spread``), a matrix with ``std(name, shape)``, a vector (a bias, a norm's bias) with 0.02."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in shapes.items():
        noise = rng.standard_normal(shape, np.float32)
        if len(shape) == 1:
            norm = "norm" in name.lower() or ".ln_" in name
            noise = 1 + noise * norm_spread if norm and name.endswith("weight") else noise * 0.02
        else:
            noise *= np.float32(std(name, shape))
        weights[name] = noise.astype(dtype, copy=False)
    return weights


def save(path: Path, config: dict, weights: dict[str, np.ndarray], tokenizer: Tokenizer, tokenizer_config: dict,
         generation_config: dict | None = None) -> None:
    """The folder's files, as ``save_pretrained`` names them."""
    save_params(path / "model.safetensors", weights)
    tokenizer.save(str(path / "tokenizer.json"))
    files = {"config.json": config, "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **tokenizer_config}}
    if generation_config is not None:
        files["generation_config.json"] = generation_config
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
