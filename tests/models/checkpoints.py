"""Small Hugging Face checkpoints made here, as a user's would be: models built by ``transformers`` from a
config (random weights from a fixed seed, wider than the default init so that greedy decoding varies),
saved with ``save_pretrained``, and tokenizers trained offline with ``tokenizers`` on a short text, saved
by ``transformers`` beside them. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CORPUS = [
    "Once upon a time there was a little model that wanted to serve text to everyone who asked.",
    "It read every prompt with care, wrote one token at a time, and never kept anyone waiting long.",
    "The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly.",
    "Numbers like 12345 and 2026, symbols such as #@$% and (brackets) appear in real text too.",
    "Café, naïve, façade, jalapeño, straße, 東京, Ελληνικά and ✓ marks: text is not only ASCII.",
    "A server batches requests, a scheduler admits them into slots, and a cache keeps their keys.",
] * 4
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_level_tokenizer(vocabulary: int, bos: str, eos: str, add_bos: bool) -> Tokenizer:
    """A byte-level BPE as GPT-2's and Llama 3's (every byte a token, merges learnt on ``CORPUS``)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys([bos, eos]))
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocabulary, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def byte_fallback_tokenizer(vocabulary: int) -> Tokenizer:
    """A SentencePiece-style BPE as Llama 2's and Mistral's first: spaces as "▁", ``<0xNN>`` tokens for
    the bytes of characters the merges learnt on ``CORPUS`` lack, <s> text."""
    specials = ["<unk>", "<s>", "</s>"]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learnt = Tokenizer(models.BPE(unk_token="<unk>"))
    learnt.normalizer = normalizer
    learnt.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocabulary - 256, special_tokens=specials))
    model = json.loads(learnt.to_str())["model"]
    pieces = [*specials, *(f"<0x{byte:02X}>" for byte in range(256)),
              *(piece for piece in sorted(model["vocab"], key=model["vocab"].get) if piece not in specials)]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)},
                                     [tuple(merge) for merge in model["merges"]], unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return tokenizer


def wordpiece_tokenizer(vocabulary: int) -> Tokenizer:
    """A WordPiece as BERT's: lower-cased, [CLS] text [SEP]."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=vocabulary, special_tokens=specials))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def widen(model: torch.nn.Module, seed: int, std: float = 0.25) -> torch.nn.Module:
    """Every weight random from ``seed`` (normal, ``std``; norms around 1), so that greedy decoding varies."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * std
            parameter.copy_(1 + noise * 0.2 if "norm" in name.lower() and name.endswith("weight") else noise)
    return model.eval()


def widen_gpt2(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """GPT-2's weights random from ``seed``: small embeddings and wide blocks (std 2.4 / sqrt(fan in)), so
    that the blocks and not the tied embedding alone pick the next token (greedy decoding then varies)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            wide = parameter.ndim == 2 and not name.endswith(("wte.weight", "wpe.weight"))
            noise = torch.randn(parameter.shape, generator=generator) * (2.4 / parameter.shape[0] ** 0.5 if wide
                                                                         else 0.02)
            parameter.copy_(1 + noise * 5 if ".ln_" in name and name.endswith("weight") else noise)
    return model.eval()


def save(folder: Path, model: torch.nn.Module, tokenizer: Tokenizer, bos: str | None, eos: str | None,
         pad: str | None = None, **save_options) -> Path:
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.chat_template = CHAT_TEMPLATE
    model.save_pretrained(folder, **save_options)
    fast.save_pretrained(folder)
    return folder


VOCABULARY = 320


def gpt2(folder: Path, heads: int = 8, tied: bool = True, seed: int = 0, dtype=torch.float32, positions: int = 256,
         **save_options) -> Path:
    tokenizer = byte_level_tokenizer(VOCABULARY, "<|endoftext|>", "<|endoftext|>", add_bos=False)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = GPT2Config(vocab_size=VOCABULARY, n_positions=positions, n_embd=64, n_layer=2, n_head=heads,
                        tie_word_embeddings=tied, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    model = widen_gpt2(GPT2LMHeadModel(config), seed).to(dtype)
    return save(folder, model, tokenizer, "<|endoftext|>", "<|endoftext|>", **save_options)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama(folder: Path, architecture: str = "llama", heads: int = 8, kv_heads: int = 2, tied: bool = False,
          rope: dict | None = None, seed: int = 0, dtype=torch.float32, head_dim: int | None = None,
          **save_options) -> Path:
    tokenizer = byte_level_tokenizer(VOCABULARY, "<|begin_of_text|>", "<|end_of_text|>", add_bos=True)
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
             "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
             "phi3": (Phi3Config, Phi3ForCausalLM)}
    config_class, model_class = kinds[architecture]
    extra = {"rope_parameters": {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}}
    if architecture == "mistral":
        extra["sliding_window"] = None
    if architecture == "phi3":
        extra["pad_token_id"] = eos  # Phi3Config's default, 32000, is past this vocabulary
    if head_dim is not None:
        extra["head_dim"] = head_dim
    config = config_class(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                          tie_word_embeddings=tied, bos_token_id=bos, eos_token_id=eos, **extra)
    torch.manual_seed(seed)
    model = widen(model_class(config), seed).to(dtype)
    return save(folder, model, tokenizer, "<|begin_of_text|>", "<|end_of_text|>", **save_options)


def tokenizer_only(folder: Path) -> Path:
    """A folder with a Llama 2-style byte-fallback tokenizer and a config.json that names no weights: what
    the tokenizer tests read (a checkpoint's tokenizer is read from its folder)."""
    fast = PreTrainedTokenizerFast(tokenizer_object=byte_fallback_tokenizer(512), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 512}))
    return folder


def bert(folder: Path, task: str = "classification", seed: int = 0) -> Path:
    tokenizer = wordpiece_tokenizer(VOCABULARY)
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                        id2label={0: "negative", 1: "neutral", 2: "positive"},
                        label2id={"negative": 0, "neutral": 1, "positive": 2},
                        pad_token_id=tokenizer.token_to_id("[PAD]"))
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config) if task == "classification" else BertModel(config)
    widen(model, seed, std=0.1)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


VARIANTS = {  # the config variants the tests compare, by name
    "gpt2-8-heads": lambda folder: gpt2(folder, heads=8),
    "gpt2-untied": lambda folder: gpt2(folder, heads=4, tied=False, seed=1),
    "llama-gqa-llama3-rope": lambda folder: llama(folder, rope=LLAMA3_ROPE),
    "llama-tied": lambda folder: llama(folder, heads=4, kv_heads=4, tied=True, seed=2),
    "qwen2-biases": lambda folder: llama(folder, "qwen2", seed=3),
    "mistral": lambda folder: llama(folder, "mistral", heads=4, kv_heads=1, seed=4),
    "qwen3-qk-norms": lambda folder: llama(folder, "qwen3", head_dim=16, seed=7),  # heads x head_dim != width
    "phi3-fused": lambda folder: llama(folder, "phi3", seed=8),  # qkv_proj and gate_up_proj
    "llama-sharded": lambda folder: llama(folder, seed=5, max_shard_size="40KB"),
    "llama-bfloat16": lambda folder: llama(folder, seed=6, dtype=torch.bfloat16),
}
TOKENIZERS = {"llama2-byte-fallback": tokenizer_only}  # folders with a tokenizer alone, by name
