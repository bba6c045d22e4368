"""The paged KV cache (``from_pretrained``'s default) against the slot cache and ``transformers``, on a real
checkpoint: 64 concurrent requests whose keys and values would not fit in slots x max_length, a shared
200-token prefix reused from the prefix cache, preemption forced by a small pool, and a request that could
never fit refused; equal greedy and seeded-sampling outputs throughout."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from checkpoints import CORPUS
from test_pretrained import NEW_TOKENS, expected_text, reference

import jitserve as js
from waiting import generated_at_once

VARIANT = "llama-gqa-llama3-rope"
MAX_LENGTH = 256
STEPS = NEW_TOKENS
WORDS = " ".join(CORPUS[:6]).split()
PROMPTS = [" ".join(WORDS[i:i + 1 + 7 * i]) for i in range(8)]  # 1 to 50 words
PREFIX = " ".join(CORPUS[:4])  # about 180 tokens
SAMPLED = {"temperature": 0.8, "top_k": 30, "top_p": 0.95}


def run_all(name, requests):
    """Every ``(prompt, options)`` of ``requests`` at once, from as many threads."""
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: js.generate(name, r[0], max_steps=STEPS, **r[1]), requests))


def requests_of(prompts):
    """Each prompt greedy and sampled with a seed of its own."""
    return [(p, {}) for p in prompts] + [(p, {**SAMPLED, "seed": i}) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def slot_answers(made):
    """What the slot cache gives, one request at a time (no prefix cache, no preemption)."""
    slots = js.from_pretrained(made(VARIANT), kv_cache="slots", slots=2, max_length=MAX_LENGTH,
                               prefill_lengths=[16, 64, 256])
    prompts = PROMPTS + [PREFIX + f" Question {i}:" for i in range(4)]
    with js.serve(slots, name="slot-cache"):
        return {(p, o.get("seed")): js.generate("slot-cache", p, max_steps=STEPS, **o) for p, o in requests_of(prompts)}


def test_64_requests_whose_cache_would_not_fit_slots_run_at_once_and_equal_the_slot_cache(made, slot_answers):
    folder = made(VARIANT)
    paged = js.from_pretrained(folder, slots=64, max_length=MAX_LENGTH, kv_cache_tokens=16 * MAX_LENGTH,
                               prefill_lengths=[16, 64])
    requests = requests_of(PROMPTS) * 4
    assert len(requests) == 64 and 64 * MAX_LENGTH > 16 * MAX_LENGTH
    answers, stats = generated_at_once(paged, requests, STEPS)
    assert answers == [slot_answers[p, o.get("seed")] for p, o in requests]
    model, tokenizer = reference(folder)
    assert answers[:8] == [expected_text(model, tokenizer, p) for p in PROMPTS]
    assert stats.max_slots_busy > 16, "more sequences ran at once than 16 slots of max_length would hold"
    assert stats.kv_blocks == 16 * MAX_LENGTH // 16 and stats.kv_blocks_used == 0 and stats.slots_busy == 0


def test_a_shared_prefix_is_prefilled_once_and_reused_by_every_request_with_equal_outputs(made, slot_answers):
    paged = js.from_pretrained(made(VARIANT), slots=16, max_length=MAX_LENGTH, prefill_lengths=[16, 64])
    prompts = [PREFIX + f" Question {i % 4}:" for i in range(16)]
    with js.serve(paged, name="prefixed") as server:
        first = js.generate("prefixed", prompts[0], max_steps=STEPS)
        answers = run_all("prefixed", [(p, {}) for p in prompts])
        stats = server.stats()
    prefix_blocks = len(paged.prompt_of(PREFIX)) // 16
    assert prefix_blocks >= 10
    assert [first, *answers] == [slot_answers[p, None] for p in prompts[:1] + prompts]
    assert stats.prefix_hits >= 16 * prefix_blocks, "each of the 16 found the prefix's blocks cached"
    assert stats.prefix_lookups >= stats.prefix_hits


def test_a_small_pool_preempts_and_every_request_finishes_with_its_unpreempted_output(made, slot_answers):
    paged = js.from_pretrained(made(VARIANT), slots=16, max_length=MAX_LENGTH, kv_cache_tokens=256,
                               prefill_lengths=[16, 64])
    requests = requests_of(PROMPTS)
    answers, stats = generated_at_once(paged, requests, STEPS)
    assert stats.preemptions > 0, "16 sequences of up to 176 positions do not fit 16 blocks of 16 at once"
    assert answers == [slot_answers[p, o.get("seed")] for p, o in requests]
    assert stats.kv_blocks_used == 0


def test_a_request_that_could_never_fit_the_pool_is_refused_before_any_output(made):
    paged = js.from_pretrained(made(VARIANT), slots=2, max_length=MAX_LENGTH, kv_cache_tokens=64,
                               prefill_lengths=[16])
    text = " ".join(WORDS[:60])
    positions = len(paged.prompt_of(text)) + 20 - 1
    with js.serve(paged, name="tiny"):
        with pytest.raises(js.PromptTooLongError) as refused:
            js.generate("tiny", text, max_steps=20)
        assert str(refused.value).endswith(f"need {positions} positions of KV cache; the whole cache of generation "
                                           f"server 'tiny' holds 64 (4 blocks of 16)")
        assert js.generate("tiny", "Once", max_steps=4)


def test_the_evaluator_pages_as_xla_does_and_iree_keeps_the_slot_cache(made):
    folder = made(VARIANT)
    small = {"slots": 2, "max_length": 64, "prefill_lengths": [16], "kv_cache_tokens": 128}
    answers = []
    for compiler in ("xla", "evaluator"):
        generation = js.from_pretrained(folder, compiler=compiler, **small)
        assert generation.engine == "paged"
        with js.serve(generation, name=f"paged-{compiler}"):
            answers.append(js.generate(f"paged-{compiler}", "Once upon a time", max_steps=10))
    assert answers[0] == answers[1]
    on_iree = {name: value for name, value in small.items() if name != "kv_cache_tokens"}
    assert js.from_pretrained(folder, compiler="iree", **on_iree).engine == "slots", \
        "IREE writes through block tables to other tokens"
    with pytest.raises(js.OptionError, match=r"kv_cache_tokens size a paged cache; this generation keeps a slot "
                                             r"cache \(kv_cache='slots', as its compiler or devices ask\)"):
        js.from_pretrained(folder, compiler="iree", **small)
    with pytest.raises(js.OptionError, match="compiler 'iree' does not run a paged cache's programs as XLA does; "
                                             "serve this generation with compiler 'xla' or 'evaluator'"):
        js.from_pretrained(folder, compiler="iree", kv_cache="paged", **small)


def test_stop_token_ids_and_min_tokens_in_the_paged_cache_as_in_the_slot_cache(made):
    checkpoint = js.from_pretrained(made(VARIANT), max_length=64, prefill_lengths=[16])
    ids = np.asarray(checkpoint.prompt_of("Once upon a time"))
    common = {"params": checkpoint.params, "slots": 2, "max_length": 64, "prefill_lengths": [16], "logits": True}
    paged = js.Generation(forward=checkpoint.forward, cache=checkpoint.cache, **common)
    with js.serve(paged, name="ids"):
        plain = js.generate("ids", ids, max_steps=12).tolist()
    eos, stop = plain[1], plain[4]
    answers = {}
    for engine in ("paged", "slots"):
        generation = js.Generation(forward=checkpoint.forward, cache=checkpoint.cache, eos=eos, **common) \
            if engine == "paged" else js.from_pretrained(made(VARIANT), kv_cache="slots", max_length=64,
                                                         prefill_lengths=[16])
        if engine == "slots":
            generation = js.Generation(generation.prefill, generation.decode, eos=eos, **common)
        with js.serve(generation, name=f"held-{engine}"):
            answers[engine] = [js.generate(f"held-{engine}", ids, max_steps=12, **options).tolist() for options in
                               ({}, {"min_tokens": 6, "stop_token_ids": [stop]}, {"stop_token_ids": [plain[0]]})]
    assert answers["paged"] == answers["slots"]
    ended, held, first = answers["paged"]
    assert ended == plain[:2] and first == plain[:1]
    assert len(held) >= 6 and not {eos, stop} & set(held[:6])


def test_n_samples_of_one_prompt_share_its_blocks_and_equal_their_runs_alone(made):
    paged = js.from_pretrained(made(VARIANT), slots=8, max_length=MAX_LENGTH, prefill_lengths=[16, 64])
    prompt = PROMPTS[-1]
    requests = [(prompt, {**SAMPLED, "seed": seed}) for seed in range(4)]
    with js.serve(paged, name="n-samples") as server:
        together = run_all("n-samples", requests)
        shared = server.stats().prefix_hits
        alone = [js.generate("n-samples", p, max_steps=STEPS, **o) for p, o in requests]
    blocks = (len(paged.prompt_of(prompt)) - 1) // 16
    assert blocks >= 3 and shared >= 3 * blocks, "the 3 twins took the first's prompt blocks"
    assert together == alone and len(set(together)) > 1
