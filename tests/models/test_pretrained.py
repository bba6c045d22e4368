"""``js.from_pretrained`` against ``transformers`` on checkpoints ``transformers`` saved: the same token ids,
the same logits, and the same greedy text from ``js.generate`` as from ``model.generate(do_sample=False)``
decoded by the same tokenizer, for prompts of 1 to 200 tokens, alone and 8 at once; the families added after
the first five also on the slot cache, the evaluator and IREE, and over ``/v1/completions``."""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoints import CORPUS, VARIANTS
from transformers import AutoModelForCausalLM, AutoTokenizer

import jitserve as js
from jitserve.models import layers
from jitserve.protocol import app
from jitserve.protocol.service import InferenceService
from netutil import free_port, http_front

NEW_TOKENS = 24
PROMPTS = ["a", "Once upon a time", CORPUS[4], " ".join(CORPUS[:4])]  # 1 to about 200 tokens


def reference(folder, dtype=None):
    model = AutoModelForCausalLM.from_pretrained(folder, **({"dtype": dtype} if dtype else {})).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def expected_text(model, tokenizer, prompt):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_prompts_span_1_to_200_tokens(made):
    tokenizer = AutoTokenizer.from_pretrained(made("gpt2-8-heads"))
    lengths = [len(tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert lengths[0] == 1 and 150 <= lengths[-1] <= 200, lengths


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "llama-bfloat16"])
def test_greedy_text_equals_transformers_alone_and_eight_at_once(made, variant):
    folder = made(variant)
    model, tokenizer = reference(folder)
    expected = [expected_text(model, tokenizer, prompt) for prompt in PROMPTS]
    generation = js.from_pretrained(folder, slots=4)
    assert [generation.prompt_of(p).tolist() for p in PROMPTS] == [tokenizer(p)["input_ids"] for p in PROMPTS]
    with js.serve(generation, name=variant):
        alone = [js.generate(variant, prompt, max_steps=NEW_TOKENS) for prompt in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: js.generate(variant, p, max_steps=NEW_TOKENS), PROMPTS * 2))
    assert alone == expected
    assert together == expected * 2
    assert len(set(expected[-1])) > 3, "random weights that repeat one token would prove little"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(made, variant):
    folder = made(variant)
    model, tokenizer = reference(folder, torch.float32)
    ids = tokenizer(PROMPTS[2])["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    generation = js.from_pretrained(folder, dtype="float32")
    family = generation.functions[0].args[0]
    got = np.asarray(layers.forward(family, generation.params, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_a_bfloat16_checkpoint_computes_in_bfloat16_close_to_transformers(made):
    folder = made("llama-bfloat16")
    model, tokenizer = reference(folder, torch.bfloat16)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    generation = js.from_pretrained(folder)
    assert {leaf.dtype.name for leaf in js.params.flatten(generation.params).values()} == {"bfloat16"}
    family = generation.functions[0].args[0]
    got = np.asarray(layers.forward(family, generation.params, jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_streamed_pieces_join_to_the_text_and_stop_strings_cut_it(made):
    folder = made("llama-gqa-llama3-rope")
    generation = js.from_pretrained(folder, slots=2)
    with js.serve(generation, name="stream"):
        whole = js.generate("stream", PROMPTS[1], max_steps=NEW_TOKENS)
        pieces = list(js.generate_stream("stream", PROMPTS[1], max_steps=NEW_TOKENS))
        stop = whole[len(whole) // 2:len(whole) // 2 + 2]
        cut = js.generate("stream", PROMPTS[1], max_steps=NEW_TOKENS, stop=stop)
    assert "".join(pieces) == whole and all(isinstance(p, str) and p for p in pieces)
    assert cut == whole[:whole.find(stop)]


def test_sampling_is_reproducible_by_seed_and_bad_prompts_are_refused_by_name(made):
    generation = js.from_pretrained(made("llama-tied"), slots=2, max_length=64, prefill_lengths=[16, 64])
    with js.serve(generation, name="edges"):
        sampled = [js.generate("edges", "Once", max_steps=8, temperature=0.9, seed=3, top_k=20) for _ in range(2)]
        assert sampled[0] == sampled[1] and isinstance(sampled[0], str)
        with pytest.raises(js.PromptTooLongError, match=r"the prompt has \d+ tokens, more than max_length \(64\)"):
            js.generate("edges", "word " * 80, max_steps=4)
        with pytest.raises(js.ModelError, match=r"a prompt is one text \(str, or UTF-8 bytes\); got int"):
            js.generate("edges", 123, max_steps=4)


def test_stop_sequences_are_bounded_so_matching_them_stays_cheap(made):
    generation = js.from_pretrained(made("llama-tied"), slots=1, max_length=32, prefill_lengths=[16])
    with js.serve(generation, name="stops"):
        for stop in ("x" * 300_000, ["a"] * 17):
            with pytest.raises(js.OptionError, match=r"stop takes at most 16 sequences of at most 256 characters "
                                                     r"each; got \d+, the longest [\d,]+ long"):
                js.generate("stops", "Once", max_steps=4, stop=stop)
        assert isinstance(js.generate("stops", "Once", max_steps=4, stop=["z" * 256] * 16), str)


LATER_FAMILIES = ["qwen3-qk-norms", "phi3-fused"]  # the families after the first five, tested on each cache, compiler and door


@pytest.mark.parametrize("variant", LATER_FAMILIES)
@pytest.mark.parametrize("compiler, kv_cache", [("xla", "slots"), ("evaluator", "paged"), ("iree", "slots")])
def test_the_later_families_give_transformers_greedy_text_on_each_cache_and_compiler(made, variant, compiler,
                                                                                       kv_cache):
    """The families added after the first five, beside the paged cache on XLA above: the slot cache, the
    evaluator (which pages as XLA does) and IREE (which keeps the slot cache), on short prompts (few programs)."""
    folder = made(variant)
    model, tokenizer = reference(folder)
    generation = js.from_pretrained(folder, compiler=compiler, kv_cache=kv_cache, slots=2, max_length=64,
                                    prefill_lengths=[16])
    assert generation.engine == kv_cache
    with js.serve(generation, name=f"{variant}-{compiler}"):
        got = [js.generate(f"{variant}-{compiler}", prompt, max_steps=NEW_TOKENS) for prompt in PROMPTS[:2]]
    assert got == [expected_text(model, tokenizer, prompt) for prompt in PROMPTS[:2]]


@pytest.mark.parametrize("variant", LATER_FAMILIES)
def test_the_later_families_answer_v1_completions_with_transformers_greedy_text(made, variant):
    folder = made(variant)
    expected = expected_text(*reference(folder), PROMPTS[1])
    server = js.serve(js.from_pretrained(folder, slots=2, max_length=64, prefill_lengths=[16]), name=variant)
    port = free_port()
    try:
        with http_front(app.http_config(InferenceService({variant: server}), "127.0.0.1", port)):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            connection.request("POST", "/v1/completions", json.dumps(
                {"model": variant, "prompt": PROMPTS[1], "max_tokens": NEW_TOKENS, "temperature": 0}).encode())
            response = connection.getresponse()
            status, completion = response.status, json.loads(response.read())
            connection.close()
    finally:
        server.stop()
    assert status == 200, completion
    assert completion["choices"][0]["text"] == expected
