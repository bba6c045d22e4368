"""The examples against the reference implementations no one here wrote: ``transformers`` loads the same
checkpoint folders that ``examples/make_checkpoint.py`` made without it (``AutoModelForCausalLM``,
``AutoModelForSequenceClassification``, ``AutoModel``, ``AutoTokenizer``), every weight by its name, and
gives the same token ids, the same greedy text and the same probabilities and vectors as the examples'
``js.from_pretrained`` servings, on XLA and on IREE (small configs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import jitserve as js
from jitserve.params import flatten
from waiting import generated_at_once

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NEW_TOKENS = 24


def example(name):
    """``examples/NAME.py`` loaded as ``jitserve serve`` loads it: its folder importable, for its sibling
    ``make_checkpoint``."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


@pytest.fixture(autouse=True, scope="module")
def full_float32():
    """A GPU multiplies float32 matrices in TF32 unless told otherwise; the comparisons need float32 there,
    as on a CPU, where this changes nothing. Set process-wide: servers compile on threads of their own."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def examples():
    return {name: example(name) for name in ("gpt2", "llama", "bert")}


def folder_of(name) -> Path:
    """The checkpoint folder example ``name`` serves (examples/weights/NAME-SIZE, made on first use)."""
    return getattr(sys.modules["make_checkpoint"], name)()


def prompts():
    """Prompts of 1 token to over a hundred, from the text the tokenizers learnt and from outside it."""
    text = sys.modules["make_checkpoint"].TEXT
    return ["a", "Once upon a time", "héllo, wörld ✓", " ".join(text.splitlines()[:4])]


def test_the_examples_load_with_neither_torch_nor_transformers(examples):
    """What the examples need at run time is jitserve's core: each loads as ``jitserve serve FILE:NAME``
    loads it, in a process where importing torch or transformers fails."""
    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None\n"
            "from jitserve.cli import load_target\n"
            "for target in ('gpt2.py:generation', 'llama.py:generation', 'bert.py:serving', 'bert.py:embedding'):\n"
            "    print(type(load_target('examples/' + target)).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Generation", "Generation", "Serving", "Serving"]


@pytest.mark.parametrize("name, reference", [("gpt2", AutoModelForCausalLM), ("llama", AutoModelForCausalLM),
                                             ("bert", AutoModelForSequenceClassification)])
def test_transformers_loads_every_weight_and_tokenizes_alike(examples, name, reference):
    folder = folder_of(name)
    _, loading = reference.from_pretrained(folder, output_loading_info=True)
    assert not any(loading.values()), loading  # no missing, unexpected or misshaped key
    tokenizer = AutoTokenizer.from_pretrained(folder)
    served = examples[name].serving if name == "bert" else examples[name].generation
    for prompt in prompts():
        ours = served.prompt_of(prompt) if name != "bert" else served.preprocess([prompt]).materialize()
        expected = tokenizer(prompt)["input_ids"]
        got = ours.tolist() if name != "bert" else ours["input_ids"][0, :len(expected)].tolist()
        assert got == expected, prompt


def greedy_texts(folder):
    """transformers' greedy ``generate`` of each prompt, decoded by the same tokenizer."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    texts = []
    for prompt in prompts():
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert len(set(texts[-1])) > 3, "random weights that repeat one token would prove little"
    return texts


def generated(generation, name):
    """Each prompt's text from ``generation``: one at a time, and every prompt twice at once."""
    with js.serve(generation, name=name):
        alone = [js.generate(name, prompt, max_steps=NEW_TOKENS) for prompt in prompts()]
    both, stats = generated_at_once(generation, [(prompt, {}) for prompt in prompts() * 2], NEW_TOKENS)
    assert stats.max_slots_busy > 1
    return alone, both


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_generation_is_transformers_greedy_text_alone_and_together(examples, name):
    expected = greedy_texts(folder_of(name))
    alone, together = generated(examples[name].generation, f"example-{name}")
    assert alone == expected
    assert together == expected * 2


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_generation_on_iree_is_transformers_greedy_text(examples, name):
    """The same checkpoint on IREE, with fewer slots and prefill lengths than the example's (fewer programs
    to compile: 10 to 20 s each on this 2-core CPU)."""
    folder = folder_of(name)
    expected = greedy_texts(folder)
    on_iree = js.from_pretrained(folder, compiler="iree", slots=4, prefill_lengths=[16, 128])
    alone, together = generated(on_iree, f"example-{name}-iree")
    assert alone == expected
    assert together == expected * 2


@pytest.mark.parametrize("compiler", ["xla", "iree"])
def test_the_classifier_answers_transformers_labels_and_probabilities(examples, compiler):
    folder = folder_of("bert")
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [*prompts(), "What a great film", "a terrible, slow and boring afternoon"]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    expected = torch.softmax(logits, -1).numpy()
    serving = examples["bert"].serving if compiler == "xla" else js.from_pretrained(folder, compiler="iree",
                                                                                     batch_size=2)
    with js.serve(serving, name=f"example-bert-{compiler}"):
        served = js.batched_run(f"example-bert-{compiler}", texts)
    np.testing.assert_allclose(served["probabilities"], expected, atol=1e-5)
    assert served["label"].tolist() == [model.config.id2label[i].encode() for i in expected.argmax(-1)]
    assert np.ptp(expected, axis=0).max() > 0.02, "random weights blind to the text would prove little"


def test_the_embedding_is_transformers_hidden_states_mean_pooled(examples):
    folder = folder_of("bert")
    model, tokenizer = AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    texts = prompts()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    expected = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    with js.serve(examples["bert"].embedding, name="example-embedding"):
        served = js.batched_run("example-embedding", texts)
    np.testing.assert_allclose(served["embedding"], expected, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_that_transformers_shards_loads_whole(examples, tmp_path):
    """``save_pretrained`` with a small ``max_shard_size`` writes shards and their index, as the checkpoints
    of large models come: ``js.load_params`` of the folder is every array of the model's state dict."""
    reference = AutoModelForCausalLM.from_pretrained(folder_of("gpt2"))
    reference.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded = flatten(js.load_params(tmp_path))
    state = {name: tensor.numpy() for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
    assert loaded.keys() == state.keys()  # lm_head is tied to wte, and transformers saves it once
    for name, array in state.items():
        np.testing.assert_array_equal(loaded[name], array)
