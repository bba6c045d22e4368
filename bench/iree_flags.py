"""IREE against numpy, the evaluator and XLA on softmax 1000x1000x5 (NxIREE's table for this
machine), and the per-call cost of ``jitserve.iree.call`` against a raw ``iree.runtime`` call.

The call overhead is measured on NxIREE's 4-element example module, where the call is all there is,
in ABBA rounds (raw, ours, ours, raw); best per-call times and their ratio. Goal: <= 1.10.

Last, what jitserve's correctness flags (``iree.CORRECTNESS_FLAGS``: no indirect command buffers, no
hoisted constant expressions) cost against IREE's defaults, on the MLP of bench/serving.py at batch 64
and 1, in ABBA rounds.

    python3 dev.py bench iree_flags
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import jitserve as js
from jitserve import iree
from jitserve.workloads import softmax, softmax_numpy, time_call

SEED_MLIR = (Path(__file__).resolve().parents[1] / "examples" / "cos_sin.mlir").read_text()  # NxIREE's example module


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per softmax cell")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    x = (np.arange(1000 * 1000 * 5, dtype=np.float32).reshape(1000, 1000, 5)) / (1024 * 1024)
    rows = [("numpy eager", time_call(lambda: softmax_numpy(x), args.budget))]
    for name in ["evaluator", "xla", "iree"]:
        compiled = js.compile(softmax, [js.template(x.shape, "float32")], compiler=name)
        rows.append((name, time_call(lambda: np.asarray(compiled(x)), args.budget)))
    print("softmax on 1000x1000x5 float32 (median; results as numpy arrays):")
    print("| compiler | time | vs numpy eager |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} ms | {rows[0][1] / seconds:.2f}x |")

    module = iree.compile(SEED_MLIR, iree.default_flags("local-task"), output_container=js.template((4,), "float32"))
    inputs = [np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([1, -1, 1, -1], np.int32)]
    iree.call(module, inputs)
    raw = module.function("local-task://")
    ours = lambda: iree.call(module, inputs)  # noqa: E731
    bare = lambda: raw(*inputs)  # noqa: E731
    raws, oursl, ratios = [], [], []
    for _ in range(args.rounds):
        a = per_call_us(bare, args.calls)
        b = per_call_us(ours, args.calls) + per_call_us(ours, args.calls)
        a += per_call_us(bare, args.calls)
        raws.append(a / 2), oursl.append(b / 2), ratios.append(b / a)
    print()
    print(f"call overhead, NxIREE's example module on local-task ({args.rounds} rounds x {args.calls} calls):")
    print("| raw iree.runtime best (us/call) | jitserve.iree.call best (us/call) | best ratio | median ratio |")
    print("|---|---|---|---|")
    print(f"| {min(raws):.2f} | {min(oursl):.2f} | {min(oursl) / min(raws):.3f} | {statistics.median(ratios):.3f} |")
    correctness_flags_cost(max(args.rounds // 4, 5), max(args.calls // 20, 50))


def correctness_flags_cost(rounds: int, calls: int) -> None:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 1024)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((1024, 256)).astype(np.float32) * 0.05
    print()
    print(f"jitserve's IREE flags against IREE's defaults, MLP 256-1024-256 ({rounds} rounds x {calls} calls):")
    print("| batch | IREE defaults best (us/call) | jitserve flags best (us/call) | ratio |")
    print("|---|---|---|---|")
    for rows in (1, 64):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        lowered = js.to_mlir(lambda v: jnp.tanh(v @ w1) @ w2, [x])
        functions = []
        for extra in (["--iree-hal-indirect-command-buffers=true", "--iree-opt-const-expr-hoisting=true"], []):
            module = iree.compile(lowered.mlir_module, iree.default_flags("local-task") + extra, lowered.output_container)
            run = module.function("local-task://")
            functions.append(lambda run=run: np.asarray(run(x)))
        defaults, ours = [], []
        for _ in range(rounds):
            a = per_call_us(functions[0], calls)
            b = per_call_us(functions[1], calls) + per_call_us(functions[1], calls)
            a += per_call_us(functions[0], calls)
            defaults.append(a / 2), ours.append(b / 2)
        print(f"| {rows} | {min(defaults):.1f} | {min(ours):.1f} | {min(ours) / min(defaults):.3f} |")


if __name__ == "__main__":
    main()
