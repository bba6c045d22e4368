"""Servings for the Ray tests (this module travels to the replicas by value)."""

from __future__ import annotations

import os
import time

import numpy as np

import jitserve as js


def affine(x):
    return x * 2 + 1


affine_serving = js.Serving(affine, batch_size=16, batch_timeout=0.005, input_template=js.template((4,), "float32"))
instant_serving = js.Serving(affine, batch_size=16, batch_timeout=0, input_template=js.template((4,), "float32"))


def recording_serving(folder: str) -> js.Serving:
    """Doubles int32 ids and appends every id it ran (0 is padding) to a file per replica process."""

    def record(ids: np.ndarray) -> np.ndarray:
        with open(os.path.join(folder, f"{os.getpid()}.ids"), "a") as out:
            out.write("".join(f"{int(v)}\n" for v in ids[:, 0] if v))
        return ids * 2

    return js.Serving(record, batch_size=8, batch_timeout=0.002, compiler="eager")


def slow_serving(max_queue: int | None, batch_size: int = 1) -> js.Serving:
    def slow(x: np.ndarray) -> np.ndarray:
        time.sleep(0.3)
        return x * 2 + 1

    return js.Serving(slow, batch_size=batch_size, batch_timeout=0, max_queue=max_queue, compiler="eager")


def _lengths(texts):
    """preprocess: a list of texts -> (their lengths as a batch, how many there were)."""
    return js.Batch.concatenate([np.array([[len(t)] for t in texts], np.float32)]), len(texts)


def _labelled(result, count):
    """postprocess with info: ((outputs, batch reports), info) -> outputs with the info and the reports."""
    outputs, reports = result
    return {"doubled": outputs, "count": count, "batches": len(reports)}


text_serving = js.Serving(lambda x: x * 2, batch_size=4, batch_timeout=0.002, preprocess=_lengths,
                          postprocess=_labelled, input_template=js.template((1,), "float32"))


def weights_serving(side: int = 7200) -> js.Serving:
    """A serving with 207 MB of params (float32 side x side), whose answers show they arrived:
    x * 2 + w[0, :4] with w[0, :4] = 1, 2, 3, 4."""
    w = np.zeros((side, side), np.float32)
    w[0, :4] = [1, 2, 3, 4]
    return js.Serving(lambda params, x: x * 2 + params["w"][0, :4], params={"w": w}, batch_size=8,
                      batch_timeout=0.002, input_template=js.template((4,), "float32"))


GENERATION_VOCAB = 97


def _peaked(token):
    import jax.numpy as jnp

    return -jnp.abs(jnp.arange(GENERATION_VOCAB) - token).astype(jnp.float32) / 4.0


def _prefill(params, tokens, length):
    import jax.numpy as jnp

    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0)) * params["scale"]
    return {"position": length, "total": total}, _peaked(total % GENERATION_VOCAB)


def _decode(params, state, last):
    import jax

    total = state["total"] + last * params["scale"] + state["position"]
    return {"position": state["position"] + 1, "total": total}, jax.vmap(_peaked)(total % GENERATION_VOCAB)


def generation(slots: int = 2) -> js.Generation:
    """The toy decoder of the generation tests, as logits: its state (position, running sum), its greedy
    token the sum modulo 97."""
    return js.Generation(_prefill, _decode, params={"scale": np.int32(1)}, slots=slots, max_length=64,
                         prefill_lengths=[8], logits=True)


def _steps(x: np.ndarray):
    """A streaming serving's function: three steps, x + 1, x + 2, x + 3, 150 ms apart."""
    for step in range(1, 4):
        time.sleep(0.15)
        yield x + step


stepping_serving = js.Serving(_steps, batch_size=8, batch_timeout=0.02, streaming=True)
