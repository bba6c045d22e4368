"""The evaluator against numpy eager and XLA on softmax, and its peak memory.

Times (median of repeated calls) at 1,000 / 1,000,000 / 1000x1000x5 elements,
and the evaluator's peak traced memory on 1000x1000x5 with and without freeing
each value after its last use. Goals: evaluator <= 1.3x numpy eager; peak
memory measurably below the keep-everything run.

    python3 dev.py bench evaluator
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

import numpy as np

import jitserve as js
from jitserve.workloads import DEMO_SHAPES, softmax, softmax_numpy, time_call


def peak_mib(fn, x) -> float:
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn(x)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per cell")
    args = parser.parse_args()
    rng = np.random.default_rng(12)
    evaluator = js.jit(softmax, compiler="evaluator")
    xla = js.jit(softmax, compiler="xla")
    print("| input | numpy eager | evaluator | XLA | evaluator / numpy |")
    print("|---|---|---|---|---|")
    for label, shape in DEMO_SHAPES.items():
        x = rng.uniform(size=shape).astype(np.float32)
        t_numpy = time_call(lambda: softmax_numpy(x), args.budget)
        t_eval = time_call(lambda: evaluator(x), args.budget)
        t_xla = time_call(lambda: xla(x), args.budget)
        print(f"| {label} | {t_numpy * 1e3:.3f} ms | {t_eval * 1e3:.3f} ms | {t_xla * 1e3:.3f} ms "
              f"| {t_eval / t_numpy:.2f}x |")

    x = rng.uniform(size=DEMO_SHAPES["1000x1000x5"]).astype(np.float32)
    keep_all = js.jit(softmax, compiler="evaluator", free_after_last_use=False)
    freeing, keeping = peak_mib(evaluator, x), peak_mib(keep_all, x)
    print()
    print(f"peak memory on 1000x1000x5 float32 (input {x.nbytes / 2**20:.1f} MiB, not counted):")
    print("| evaluator | peak MiB |")
    print("|---|---|")
    print(f"| free after last use | {freeing:.1f} |")
    print(f"| keep every value | {keeping:.1f} |")
    print(f"| saving | {100 * (1 - freeing / keeping):.0f}% |")


if __name__ == "__main__":
    main()
