"""The real architectures of examples/ against the reference implementations no one here wrote: Hugging
Face ``transformers``' PyTorch ``GPT2LMHeadModel`` and ``BertForSequenceClassification``, built from a config
and loaded with the same ``.safetensors`` weights (small configs; the README has a full-size run)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import jitserve as js
from jitserve.params import flatten

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True, scope="module")
def full_float32():
    """A GPU multiplies float32 matrices in TF32 unless told otherwise (GPT-2's logits then differ from
    transformers' by up to 4e-3 at the small config); the comparisons need float32 there, as on a CPU,
    where this changes nothing. Set process-wide: servers compile on threads of their own."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


def loaded(model, params):
    """``model`` with ``params`` (the example's tree, as saved) loaded; every parameter must be set."""
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in flatten(params).items()},
                                                strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head is tied to wte
    return model.eval()


@pytest.fixture(scope="module")
def gpt2():
    module = example("gpt2")
    c = module.CONFIG
    config = GPT2Config(vocab_size=c["vocab_size"], n_positions=c["n_positions"], n_embd=c["n_embd"],
                        n_layer=c["n_layer"], n_head=c["n_head"], activation_function="gelu_new",
                        layer_norm_epsilon=module.LAYER_NORM_EPS, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                        bos_token_id=None, eos_token_id=None)  # no end token: plain greedy, as js.Generation's
    return module, loaded(GPT2LMHeadModel(config), module.load())


@pytest.fixture(scope="module")
def bert():
    module = example("bert")
    config = BertConfig(**module.CONFIG, num_labels=len(module.LABELS), hidden_act="gelu", hidden_dropout_prob=0,
                        attention_probs_dropout_prob=0, layer_norm_eps=module.LAYER_NORM_EPS)
    return module, loaded(BertForSequenceClassification(config), module.load())


@pytest.mark.parametrize("compiler", ["xla", "iree"])
def test_gpt2_served_agrees_with_transformers(gpt2, compiler):
    module, reference = gpt2
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, module.CONFIG["vocab_size"], (5, module.CONTEXT)).astype(np.int32)
    lengths = np.array([1, 5, 17, 31, 32], np.int32)
    with torch.no_grad():
        expected = np.stack([reference(torch.from_numpy(tokens[i:i + 1, :n]).long()).logits[0, -1].numpy()
                             for i, n in enumerate(lengths)])
    name = f"gpt2-{compiler}"
    with js.serve(module.serving.replace(compiler=compiler), name=name):
        served = js.batched_run(name, js.Batch.concatenate([{"tokens": tokens, "length": lengths}]))
    np.testing.assert_allclose(served["logits"], expected, rtol=1e-4, atol=1e-4)
    assert served["next_token"].tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("compiler", ["xla", "iree"])
def test_bert_served_from_text_agrees_with_transformers(bert, compiler):
    module, reference = bert
    texts = ["a great film", "terrible, just terrible", "ok", "é ünïcode 文字", "x" * 200]
    tokens = module.tokenize(texts)
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(tokens["input_ids"]).long(),
                           attention_mask=torch.from_numpy(tokens["attention_mask"]).long()).logits.numpy()
    expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    name = f"bert-{compiler}"
    with js.serve(module.serving.replace(compiler=compiler), name=name):
        served = js.batched_run(name, texts)
    np.testing.assert_allclose(served["probabilities"], expected, rtol=1e-4, atol=1e-5)
    assert served["label"].tolist() == [module.LABELS[i].encode() for i in logits.argmax(-1)]


def greedy_reference(gpt2, lengths, steps=24):
    """Prompts of ``lengths`` drawn from a fixed seed, and transformers' greedy ``generate`` of each."""
    module, reference = gpt2
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, module.CONFIG["vocab_size"], n).astype(np.int32) for n in lengths]
    with torch.no_grad():
        expected = [reference.generate(torch.from_numpy(p[None]).long(), max_new_tokens=steps,
                                       do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert len({tuple(tokens) for tokens in expected}) == len(prompts) and len(set(expected[0])) > 3, \
        "the weights generate varied tokens, so that agreement means something"
    return prompts, expected


def generated_together(name, prompts, steps=24):
    """The tokens of each prompt from generation server ``name``, every prompt sent at once."""
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, js.generate(name, prompts[i], max_steps=steps).tolist())) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [results.get(i) for i in range(len(prompts))]


def test_gpt2_generation_is_transformers_greedy_generate(gpt2):
    """js.Generation over the example's KV-cache prefill and decode: the tokens of GPT2LMHeadModel.generate
    (greedy), alone and with the prompts sharing the decode steps."""
    module, _ = gpt2
    prompts, expected = greedy_reference(gpt2, (1, 4, 9, 16, 17, 32))
    with js.serve(module.generation, name="gpt2-generate") as server:
        assert [js.generate("gpt2-generate", p, max_steps=24).tolist() for p in prompts] == expected
        assert generated_together("gpt2-generate", prompts) == expected
        assert server.stats()["max_slots_busy"] > 1


def test_gpt2_generation_on_iree_is_transformers_greedy_generate(gpt2):
    """The same on IREE, whose decode writes each slot's keys and values at its own position (a scatter
    that jitserve puts in the form IREE compiles), the prompts sharing the decode steps."""
    module, _ = gpt2
    prompts, expected = greedy_reference(gpt2, (3, 16, 21))
    on_iree = js.Generation(module.prefill, module.decode, params=module.generation.params, slots=4,
                            max_length=module.MAX_LENGTH, prefill_lengths=[16, module.CONTEXT], logits=True,
                            compiler="iree")
    with js.serve(on_iree, name="gpt2-iree") as server:
        assert generated_together("gpt2-iree", prompts) == expected
        assert server.stats()["max_slots_busy"] > 1


def test_gpt2_text_generation_is_transformers_greedy_generate_on_ascii(gpt2):
    """Text in, text out: the example's byte-level tokenizer and the pieces it answers, against
    GPT2LMHeadModel.generate with every token that is not an ASCII byte suppressed."""
    module, reference = gpt2
    texts = ["héllo, wörld", "jitserve"]
    with torch.no_grad():
        expected = [bytes(reference.generate(torch.from_numpy(module.encode(text)[None]).long(), max_new_tokens=12,
                                             do_sample=False, suppress_tokens=list(range(128, 512)))[0, len(
                                                 text.encode()):].tolist()) for text in texts]
    assert len(set(expected[0])) > 3, "the weights generate varied text, so that agreement means something"
    with js.serve(module.text_generation, name="gpt2-text"):
        assert [b"".join(js.generate("gpt2-text", text, max_steps=12)) for text in texts] == expected
        assert b"".join(js.generate_stream("gpt2-text", texts[0].encode(), max_steps=12)) == expected[0]


def test_a_checkpoint_that_transformers_shards_loads_whole(gpt2, tmp_path):
    """``save_pretrained`` with a small ``max_shard_size`` writes shards and their index, as the checkpoints
    of large models come: ``js.load_params`` of the folder is every array of the model's state dict."""
    _, reference = gpt2
    reference.save_pretrained(tmp_path, max_shard_size="200KB", safe_serialization=True)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded = flatten(js.load_params(tmp_path))
    state = {name: tensor.numpy() for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
    assert loaded.keys() == state.keys()  # lm_head is tied to wte, and transformers saves it once
    for name, array in state.items():
        np.testing.assert_array_equal(loaded[name], array)
