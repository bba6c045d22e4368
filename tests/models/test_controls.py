"""Per-request controls on a real checkpoint, in the paged cache and the slot cache, against ``transformers``:
log-probabilities equal to the log-softmax of its logits, the repetition penalty equal to its ``generate``'s,
presence and frequency penalties equal to a NumPy loop over its logits, and requests that ask for them
sharing steps with requests that do not, each with its own answer and nothing compiled."""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest
import torch
from checkpoints import CORPUS
from test_pretrained import NEW_TOKENS, reference

import jitserve as js
from waiting import generated_at_once

VARIANT = "llama-gqa-llama3-rope"
PROMPTS = ["Once upon a time", CORPUS[2], " ".join(CORPUS[:2])]
ENGINES = {"paged": {}, "slots": {"kv_cache": "slots"}}
TOLERANCE = 2e-4  # float32 logits, summed in another order than torch's


def served(made, engine, **options):
    return js.from_pretrained(made(VARIANT), slots=4, max_length=128, prefill_lengths=[16, 128],
                              **ENGINES[engine], **options)


def run_all(name, requests):
    """Every ``(prompt, options)`` of ``requests`` at once, from as many threads."""
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: js.generate(name, r[0], max_steps=NEW_TOKENS, **r[1]), requests))


def log_softmax(model, ids, tokens):
    """The reference's log-probabilities of each next token after ``ids``, then each of ``tokens`` but the
    last: one row per output."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_logprobs_match(scores, expected, top):
    """Each output's log-probability and its ``top`` most likely tokens' are the reference's."""
    assert len(scores) == len(expected)
    for score, row in zip(scores, expected):
        assert abs(score.logprob - row[score.token]) < TOLERANCE
        assert len(score.top) == top
        ids = [token for token, _ in score.top]
        assert len(set(ids)) == top and [lp for _, lp in score.top] == sorted((lp for _, lp in score.top),
                                                                               reverse=True)
        for token, logprob in score.top:
            assert abs(logprob - row[token]) < TOLERANCE
        if top:  # the most likely tokens of the reference, up to near ties at the last place
            assert min(row[ids]) >= np.sort(row)[::-1][top - 1] - TOLERANCE


@pytest.mark.parametrize("engine", list(ENGINES))
def test_logprobs_equal_transformers_log_softmax_and_requests_without_them_keep_their_answers(made, engine):
    folder = made(VARIANT)
    model, tokenizer = reference(folder)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 5}
    requests = [(PROMPTS[0], {"logprobs": 5}), (PROMPTS[1], {**sampled, "logprobs": 20}),
                (PROMPTS[2], {"logprobs": 0}), (PROMPTS[0], {}), (PROMPTS[1], sampled)]
    with js.serve(served(made, engine), name=f"logprobs-{engine}") as server:
        alone = [js.generate(f"logprobs-{engine}", prompt, max_steps=NEW_TOKENS, **options)
                 for prompt, options in requests[3:]]
        compiles = server.stats().compiles
        answers = run_all(f"logprobs-{engine}", requests * 2)
        assert server.stats().compiles == compiles, "no request mix compiles a program"
    assert [tokens_of(answer) for answer in answers[5:]] == [tokens_of(answer) for answer in answers[:5]], \
        "the same tokens in another mix (log-probabilities computed in other programs differ by rounding)"
    assert answers[3:5] == alone, "requests without log-probabilities answer as alone"
    assert answers[0][0] == alone[0] and answers[1][0] == alone[1], "asking for them changes no token"
    for (prompt, options), answer in zip(requests[:3] * 2, answers[:3] + answers[5:8]):
        text, scores = answer
        assert text == tokenizer.decode(tokens_of(answer), skip_special_tokens=True)
        assert_logprobs_match(scores, log_softmax(model, tokenizer(prompt)["input_ids"], tokens_of(answer)),
                              options["logprobs"])


def tokens_of(answer):
    """The tokens of an answer with log-probabilities (else the text)."""
    return [score.token for score in answer[1]] if isinstance(answer, tuple) else answer


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_repetition_penalty_equals_transformers_generate(made, engine):
    folder = made(VARIANT)
    model, tokenizer = reference(folder)
    changed = 0
    with js.serve(served(made, engine), name=f"repetition-{engine}"):
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, repetition_penalty=1.8,
                                     attention_mask=torch.ones_like(ids))
            expected = out[0, ids.shape[1]:].tolist()
            answer = js.generate(f"repetition-{engine}", prompt, max_steps=NEW_TOKENS, repetition_penalty=1.8,
                                 logprobs=0)
            assert tokens_of(answer) == expected
            changed += answer[0] != js.generate(f"repetition-{engine}", prompt, max_steps=NEW_TOKENS)
    assert changed, "the penalty changed some text"


def penalized_greedy(model, ids, steps, repetition, presence, frequency, eos):
    """The greedy tokens after ``ids`` under the penalties' rules, in NumPy over the reference's logits: the
    repetition penalty over the prompt and the outputs (HF's), presence and frequency over the outputs
    (OpenAI's)."""
    tokens: list[int] = []
    while len(tokens) < steps and (not tokens or tokens[-1] != eos):
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, -1].numpy().astype(np.float32)
        seen = np.zeros(logits.size, bool)
        seen[ids + tokens] = True
        counts = np.bincount(np.array(tokens, np.int64), minlength=logits.size).astype(np.float32)
        logits = np.where(seen, np.where(logits < 0, logits * repetition, logits / repetition), logits)
        logits = logits - presence * (counts > 0) - frequency * counts
        tokens.append(int(np.argmax(logits)))
    return tokens


@pytest.mark.parametrize("engine", list(ENGINES))
def test_presence_and_frequency_penalties_equal_a_numpy_loop_and_mix_with_plain_requests(made, engine):
    folder = made(VARIANT)
    model, tokenizer = reference(folder)
    penalties = [{"presence_penalty": -2.0}, {"presence_penalty": 1.5, "frequency_penalty": 0.9},
                 {"presence_penalty": -0.5, "frequency_penalty": 1.2, "repetition_penalty": 1.3}]
    requests = [(prompt, {**options, "logprobs": 0}) for prompt, options in zip(PROMPTS, penalties)]
    with js.serve(served(made, engine), name=f"penalties-{engine}") as server:
        plain = [js.generate(f"penalties-{engine}", prompt, max_steps=NEW_TOKENS) for prompt in PROMPTS]
        compiles = server.stats().compiles
        mixed = run_all(f"penalties-{engine}", [*requests, *((prompt, {}) for prompt in PROMPTS)] * 2)
        assert server.stats().compiles == compiles
    assert mixed[3:6] == plain and mixed[9:] == plain, "plain requests beside penalized ones answer as alone"
    assert [tokens_of(answer) for answer in mixed[6:9]] == [tokens_of(answer) for answer in mixed[:3]]
    assert all(answer[0] != text for answer, text in zip(mixed[:3], plain)), "each penalty changed the text"
    for (prompt, options), answer in zip(requests, mixed[:3]):
        rules = {name: options.get(f"{name}_penalty", neutral)
                 for name, neutral in (("repetition", 1.0), ("presence", 0.0), ("frequency", 0.0))}
        expected = penalized_greedy(model, tokenizer(prompt)["input_ids"], NEW_TOKENS, eos=tokenizer.eos_token_id,
                                    **rules)
        assert tokens_of(answer) == expected


def test_penalized_requests_preempted_by_a_small_pool_finish_with_their_unpreempted_outputs(made):
    options = {"repetition_penalty": 1.4, "frequency_penalty": 0.5, "logprobs": 0}
    prompts = [" ".join(" ".join(CORPUS[:3]).split()[i:i + 5 + 4 * i]) for i in range(8)]
    roomy = served(made, "paged")
    with js.serve(roomy, name="roomy"):
        expected = [tokens_of(js.generate("roomy", p, max_steps=48, **options)) for p in prompts]
    tight = js.from_pretrained(made(VARIANT), slots=8, max_length=128, prefill_lengths=[16, 64],
                               kv_cache_tokens=160)
    answers, stats = generated_at_once(tight, [(prompt, options) for prompt in prompts], 48)
    assert stats.preemptions > 0, "8 sequences of up to 90 positions do not fit 10 blocks of 16"
    assert [tokens_of(answer) for answer in answers] == expected


def transformers_kept(logits, temperature, top_k, top_p, min_p):
    """The tokens ``transformers``' warpers leave drawable, in its order: temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.tensor(logits[None])
    for warper in (TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
                   TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)):
        scores = warper(None, scores)
    return set(np.flatnonzero(np.isfinite(scores.numpy()[0])).tolist())


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (0.7, 0, 1.0, 0.1), (1.5, 0, 1.0, 0.1), (1.0, 20, 0.95, 0.15), (1.0, 0, 1.0, 0.2), (0.5, 0, 1.0, 1.0)])
def test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps(temperature, top_k, top_p, min_p):
    """vLLM's and HF's ``min_p``: a token may be drawn when its probability is at least ``min_p`` times the
    most likely one's, after temperature, top-k and top-p. 2,000 seeded draws from one row of logits give
    exactly the tokens HF's warpers leave (3, 17, 4, 3 and 1 of 40 here, where without min_p 40, 40, 16, 40
    and 40)."""
    from jitserve.serving.generation.picking import sample_tokens

    logits = np.random.default_rng(3).standard_normal(40).astype(np.float32)
    draws = 2000
    rows = lambda value, dtype: np.full(draws, value, dtype)
    drawn = jax.jit(sample_tokens)(np.repeat(logits[None], draws, axis=0), rows(temperature, np.float32),
                                   rows(top_k, np.int32), rows(top_p, np.float32), rows(min_p, np.float32),
                                   np.arange(draws, dtype=np.uint32), rows(0, np.int32),
                                   np.full((draws, 1), 2**31 - 1, np.int32), np.full((draws, 1), 2**31 - 1, np.int32),
                                   np.zeros((draws, 1), np.float32), rows(0, np.int32))
    assert set(np.asarray(drawn).tolist()) == transformers_kept(logits, temperature, top_k, top_p, min_p)


def test_min_p_over_a_checkpoint_and_its_refusals(made):
    """``min_p`` 1 keeps the most likely token alone: any temperature gives the greedy text; a sampled
    request with a small ``min_p`` runs in the same programs as one without."""
    with js.serve(served(made, "paged"), name="min-p") as server:
        greedy = js.generate("min-p", PROMPTS[1], max_steps=NEW_TOKENS)
        compiles = server.stats().compiles
        assert js.generate("min-p", PROMPTS[1], max_steps=NEW_TOKENS, temperature=1.5, min_p=1.0, seed=2) == greedy
        js.generate("min-p", PROMPTS[1], max_steps=NEW_TOKENS, temperature=1.0, min_p=0.05, seed=2)
        assert server.stats().compiles == compiles
    for bad in (-0.1, 1.5, float("nan"), "0.1"):
        with pytest.raises(js.OptionError, match=r"min_p must be a number in \[0, 1\] \(0: no cut\), got"):
            js.Sampling(min_p=bad)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_logit_bias_equals_transformers_sequence_bias_of_single_tokens(made, engine):
    """OpenAI's ``logit_bias``: the greedy tokens equal ``generate``'s with HF's ``SequenceBiasLogitsProcessor``
    over one-token sequences (always applied); banning the plain answer's first token and favouring another
    changes the text, and the log-probabilities stay the model's own."""
    from transformers import LogitsProcessorList, SequenceBiasLogitsProcessor

    folder = made(VARIANT)
    model, tokenizer = reference(folder)
    name = f"bias-{engine}"
    with js.serve(served(made, engine), name=name) as server:
        for prompt in PROMPTS[:2]:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            plain = tokens_of(js.generate(name, prompt, max_steps=NEW_TOKENS, logprobs=0))
            bias = {plain[0]: -100.0, plain[1]: 4.5, 7: 2.0}
            processor = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias.items()])
            with torch.no_grad():
                out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                     logits_processor=LogitsProcessorList([processor]),
                                     attention_mask=torch.ones_like(ids))
            expected = out[0, ids.shape[1]:].tolist()
            text, scores = js.generate(name, prompt, max_steps=NEW_TOKENS, logit_bias=bias, logprobs=0)
            assert [score.token for score in scores] == expected and expected[0] != plain[0]
            assert text == tokenizer.decode(expected, skip_special_tokens=True)
            assert_logprobs_match(scores, log_softmax(model, ids[0].tolist(), expected), 0)
        compiles = server.stats().compiles
        js.generate(name, PROMPTS[0], max_steps=2, temperature=1.0, seed=1, logit_bias={3: 1.0})
        assert server.stats().compiles == compiles, "a bias is an option of the programs, not a program"
        vocabulary = model.config.vocab_size
        with pytest.raises(js.OptionError, match=rf"logit_bias names token {vocabulary}, past the vocabulary of "
                                                 rf"generation server '{name}' \({vocabulary} tokens\)"):
            js.generate(name, PROMPTS[0], max_steps=2, logit_bias={5: 1.0, vocabulary: 1.0})
    for bad in ({1: 101}, {-1: 1.0}, {1: float("nan")}, [1, 2], {True: 1.0}, {i: 1.0 for i in range(301)}):
        with pytest.raises(js.OptionError, match=r"logit_bias must map at most 300 token ids \(integers >= 0\) "
                                                 r"to numbers from -100 to 100, got"):
            js.Sampling(logit_bias=bad)

