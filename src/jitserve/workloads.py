"""What ``jitserve demo`` and the compiler benches measure, and how: softmax over the last axis (as a
numerical definition and in numpy) at the demo's sizes, and the median time of a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEMO_SHAPES: dict[str, tuple[int, ...]] = {
    "1,000": (1_000,),
    "1,000,000": (1_000_000,),
    "1000x1000x5": (1000, 1000, 5),
}


def softmax(t: Any) -> Any:
    """Softmax over the last axis, as a numerical definition (NxIREE's and the demo's workload)."""
    return jnp.exp(t) / jnp.sum(jnp.exp(t), axis=-1, keepdims=True)


def softmax_numpy(t: np.ndarray) -> np.ndarray:
    """The same softmax in numpy, run eagerly."""
    return np.exp(t) / np.sum(np.exp(t), axis=-1, keepdims=True)


def time_call(fn: Callable[[], Any], budget_s: float = 0.5, max_runs: int = 200) -> float:
    """Median seconds of ``fn()`` (results waited for) after one warm-up call."""
    jax.block_until_ready(fn())
    runs: list[float] = []
    spent = 0.0
    while len(runs) < 3 or (spent < budget_s and len(runs) < max_runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - start)
        spent += runs[-1]
    return statistics.median(runs)
