"""New weights on a running paged generation (``update_params``, as a model repository's reload of changed
weights does it): no request afterwards is answered from keys and values the old weights computed. A
prompt whose prefix was cached under the old weights gets what a server that only ever had the new ones
gives, with the prefix cache on and off, and a request preempted under the old weights finishes under them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from checkpoints import CORPUS

import jitserve as js
from jitserve.serving.generation import GenerationServer, Prompt

VARIANT = "llama-gqa-llama3-rope"
STEPS = 12
PREFIX = " ".join(CORPUS[:2])  # several full blocks of 16 tokens
PROMPTS = [PREFIX + f" Question {i}:" for i in range(3)]


def changed(params):
    """Other weights of the same shapes: each leaf scaled by its own random factors."""
    rng = np.random.default_rng(7)
    return jax.tree.map(lambda leaf: (np.asarray(leaf) * rng.uniform(0.5, 1.5, np.shape(leaf))).astype(leaf.dtype),
                        params)


def answers(server, prompts):
    return [server.call(Prompt(prompt, STEPS)) for prompt in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_after_a_weight_swap_cached_prefixes_are_computed_again_with_the_new_weights(made, prefix_caching):
    folder = made(VARIANT)
    options = {"slots": 4, "max_length": 160, "prefill_lengths": [16, 64], "prefix_caching": prefix_caching}
    generation = js.from_pretrained(folder, **options)
    new_weights = changed(generation.params)
    fresh = GenerationServer(js.from_pretrained(folder, **options), "fresh").start()
    try:
        fresh.update_params(new_weights)  # before any request: nothing was ever computed with the old ones
        expected = answers(fresh, PROMPTS)
    finally:
        fresh.stop()
    server = GenerationServer(generation, "swapped").start()
    try:
        before = answers(server, PROMPTS)
        server.update_params(new_weights)
        after = answers(server, PROMPTS)
        stats = server.stats()
    finally:
        server.stop()
    assert before != expected, "the new weights give other text (else this test proves nothing)"
    assert after == expected
    assert stats.kv_blocks_used == 0
    if prefix_caching:
        assert stats.prefix_hits > 0, "the prompts after the first shared the prefix among themselves"


def test_a_preempted_request_resumes_under_the_weights_it_started_with(made):
    """A pool too small for every running sequence preempts some; new weights given meanwhile wait until those
    too have finished under the old weights, so each answer is the old weights' alone or the new's alone."""
    folder = made(VARIANT)
    options = {"slots": 8, "max_length": 160, "prefill_lengths": [16, 64], "kv_cache_tokens": 192}
    generation = js.from_pretrained(folder, **options)
    new_weights = changed(generation.params)
    prompts = CORPUS[:6]
    reference = GenerationServer(js.from_pretrained(folder, **options), "reference").start()
    try:
        old = [reference.call(Prompt(prompt, 48)) for prompt in prompts]
        reference.update_params(new_weights)
        new = [reference.call(Prompt(prompt, 48)) for prompt in prompts]
    finally:
        reference.stop()
    assert all(a != b for a, b in zip(old, new)), "the new weights give other text (else this proves nothing)"
    server = GenerationServer(generation, "preempting").start()
    try:
        pending = [server.stream(Prompt(prompt, 48)) for prompt in prompts]
        firsts = [next(outputs) for outputs in pending]  # every request admitted: it runs with the old weights
        server.update_params(new_weights)
        whole = [first + "".join(outputs) for first, outputs in zip(firsts, pending)]
        stats = server.stats()
    finally:
        server.stop()
    assert stats.preemptions > 0, "the small pool preempted some sequences (else this test proves nothing)"
    assert whole == old
