"""The one contract of a served thing (serving/front.py): both engines answer a caller's typed request through
the same entry points, ``call`` and ``stream`` (and their asyncio forms), and refuse a request of the other
kind by name."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js
from jitserve.serving import Prompt, Rows

VOCAB = 97


def prefill(params, tokens, length):
    """The next id is the running sum of the sequence so far, modulo VOCAB."""
    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0))
    return {"total": total}, (total % VOCAB).astype(jnp.int32)


def decode(params, state, last):
    total = state["total"] + last
    return {"total": total}, (total % VOCAB).astype(jnp.int32)


def sums(prompt, steps):
    outputs, total = [], 0
    for token in prompt:
        total += token
    for _ in range(steps):
        outputs.append(total % VOCAB)
        total += outputs[-1]
    return outputs


@pytest.fixture(scope="module")
def fronts():
    """A serving (doubles its rows, batches of at most 2) and a generation, each served by name."""
    generation = js.Generation(prefill, decode, params={}, slots=2, max_length=32, prefill_lengths=[8])
    serving = js.Serving(lambda x: x * 2, batch_size=2, batch_timeout=0.001)
    with js.serve(serving, name="front-rows") as rows, js.serve(generation, name="front-prompt") as prompts:
        yield rows, prompts


ROWS = np.arange(3, dtype=np.float32)  # three rows: two batches of a serving of batch size 2


def test_both_engines_answer_a_typed_request_whole_or_in_pieces(fronts):
    rows, generation = fronts
    prompt = Prompt(np.array([3, 1, 4], np.int32), max_steps=4)
    whole = {rows: ROWS * 2, generation: np.array(sums([3, 1, 4], 4))}
    asked = {rows: Rows(js.Batch.concatenate([ROWS])), generation: prompt}
    for front, ask in asked.items():
        np.testing.assert_array_equal(front.call(ask), whole[front])
        pieces = list(front.stream(ask))
        assert len(pieces) == (2 if front is rows else 4), "one piece per batch that ran rows, per output"
        np.testing.assert_array_equal(np.concatenate([np.atleast_1d(p) for p in pieces]), whole[front])

    async def from_a_loop():
        for front, ask in asked.items():
            np.testing.assert_array_equal(await front.call_async(ask), whole[front])
            pieces = [piece async for piece in front.stream_async(ask)]
            np.testing.assert_array_equal(np.concatenate([np.atleast_1d(p) for p in pieces]), whole[front])

    asyncio.run(from_a_loop())


def test_a_stream_is_checked_and_queued_when_it_is_opened(fronts):
    rows, generation = fronts
    for front in fronts:
        before = front.stats().requests
        ask = Rows(js.Batch.concatenate([ROWS])) if front is rows else Prompt(np.array([2], np.int32), max_steps=3)
        pieces = front.stream(ask)
        assert front.stats().requests == before + 1, "queued before the first piece is read"
        pieces.close()
    with pytest.raises(js.OptionError) as info:
        rows.stream(Rows(js.Batch.concatenate([ROWS]), timeout=-1))
    assert str(info.value) == "timeout must be a finite number of seconds >= 0 or None, got -1"
    with pytest.raises(js.OptionError) as info:
        generation.stream(Prompt([1], max_steps=0))
    assert str(info.value) == "max_steps must be a positive integer, got 0"


def test_a_request_of_the_other_kind_is_refused_by_name(fronts):
    rows, generation = fronts
    prompt, batch = Prompt([1], max_steps=2), Rows(js.Batch.stack([np.float32(1)]))
    refusals = [
        (rows, prompt, "server 'front-rows' serves a js.Serving, not a js.Generation: call js.batched_run"),
        (generation, batch, "server 'front-prompt' serves a js.Generation, not a js.Serving: call js.generate"),
        (rows, batch.value, "server 'front-rows' takes a Rows request (js.Serving's), got Batch"),
        (generation, [1, 2], "server 'front-prompt' takes a Prompt request (js.Generation's), got list"),
    ]
    for front, ask, message in refusals:
        for entry in (front.call, front.stream):
            with pytest.raises(js.OptionError) as info:
                entry(ask)
            assert str(info.value) == message

    async def from_a_loop():
        for front, ask, message in refusals:
            with pytest.raises(js.OptionError) as info:
                await front.call_async(ask)
            assert str(info.value) == message
            with pytest.raises(js.OptionError) as info:
                front.stream_async(ask)
            assert str(info.value) == message

    asyncio.run(from_a_loop())
