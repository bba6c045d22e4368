"""A generation whose prefill and decode are written in NumPy, run as written (``compiler="eager"``): its
shapes come from one real call, as an eager Serving's do, not from tracing with JAX (issue 47, item 9)."""

from __future__ import annotations

import numpy as np

import jitserve as js


def prefill(params, tokens, length):
    tokens, length = np.asarray(tokens), int(length)  # NumPy on the concrete prompt: no tracer could do this
    row = {"total": np.asarray(tokens[:length].sum(), np.int32), "position": np.asarray(length, np.int32)}
    return row, np.asarray(tokens[length - 1] + 1, np.int32)


def decode(params, state, last):
    last = np.asarray(last)
    state = {"total": (np.asarray(state["total"]) + last).astype(np.int32),
             "position": (np.asarray(state["position"]) + 1).astype(np.int32)}
    return state, (last + np.asarray(params["step"])).astype(np.int32)


def test_a_numpy_decode_loop_generates_when_run_as_written():
    generation = js.Generation(prefill, decode, params={"step": np.int32(2)}, slots=2, max_length=32,
                               prefill_lengths=[8], compiler="eager")
    with js.serve(generation, name="numpy-loop"):
        assert js.generate("numpy-loop", np.array([1, 2, 3], np.int32), max_steps=5).tolist() == [4, 6, 8, 10, 12]
        assert js.generate("numpy-loop", np.array([7], np.int32), max_steps=3).tolist() == [8, 10, 12]
