"""Per-call dispatch cost of ``js.jit`` against raw ``jax.jit`` on a tiny input.

Both wrap the same function. Each round times ``--calls`` calls of each in
ABBA order (raw, ours, ours, raw) to cancel drift on a busy machine. The table gives
the best per-call time of each (timeit's convention: the least disturbed run)
with their ratio, and the median of the per-round ratios as a noise check.
Goal: best ratio <= 1.10.

    python3 dev.py bench dispatch
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js


def f(x):
    return x * 2.0 + 1.0


def per_call_us(fn, arg, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    jax.block_until_ready(fn(arg))
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()

    raw = jax.jit(f)
    ours = js.jit(f)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds x {args.calls} calls")
    print("| input | raw jax.jit best (us/call) | js.jit best (us/call) | best ratio | median ratio |")
    print("|---|---|---|---|---|")
    gc.disable()
    for label, arg in [("numpy float32[4]", np.ones(4, np.float32)), ("jax float32[4]", jnp.ones(4, jnp.float32))]:
        raw(arg), ours(arg)
        raws, oursl, ratios = [], [], []
        for _ in range(args.rounds):
            a = per_call_us(raw, arg, args.calls)
            b = per_call_us(ours, arg, args.calls) + per_call_us(ours, arg, args.calls)
            a += per_call_us(raw, arg, args.calls)
            raws.append(a / 2), oursl.append(b / 2), ratios.append(b / a)
        print(f"| {label} | {min(raws):.2f} | {min(oursl):.2f} | {min(oursl) / min(raws):.3f} "
              f"| {statistics.median(ratios):.3f} |")
    gc.enable()
    assert ours.compiles == 1, "dispatch must not recompile"


if __name__ == "__main__":
    main()
