"""The portability corpus (tests/compilers/corpus.py, about 290 definitions) on each compiler, against
XLA on the CPU: how many agree, how many raise a clear jitserve error, how many are wrong or fail
unclearly. The table in docs/compilers.md; run on a GPU machine with ``--device`` to count XLA on CUDA and IREE's
cuda driver.

    python3 dev.py bench portability                       # xla, evaluator, iree on this CPU
    python3 dev.py bench portability --compilers xla iree --xla-device gpu:0 --iree-device cuda:// \
        --iree-flags='--iree-hal-target-backends=cuda --iree-cuda-target=sm_90 --iree-input-type=stablehlo'
"""

from __future__ import annotations

import argparse
import collections
import runpy
import time
from pathlib import Path

import jax

corpus = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tests" / "compilers" / "corpus.py"),
                        run_name="corpus")
OUTCOMES = ("agree", "clear error", "wrong", "unclear error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compilers", nargs="+", default=["xla", "evaluator", "iree"])
    parser.add_argument("--xla-device", help="device option for compiler='xla', e.g. gpu:0")
    parser.add_argument("--iree-device", help="device option for compiler='iree', e.g. cuda://")
    parser.add_argument("--iree-flags", help="iree_compiler_flags, space-separated (default: the device's defaults); "
                                              "write --iree-flags='--a --b'")
    parser.add_argument("--precision", default="highest",
                        help="jax_default_matmul_precision (GPUs default to TF32 matmuls; 'highest' compares math)")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", args.precision)
    options = {"xla": {"device": args.xla_device} if args.xla_device else {},
               "iree": {**({"device": args.iree_device} if args.iree_device else {}),
                        **({"iree_compiler_flags": args.iree_flags.split()} if args.iree_flags else {})},
               "evaluator": {}}
    cases = corpus["CASES"]
    print(f"{len(cases)} definitions; reference: XLA on the CPU; jax {jax.__version__}, "
          f"devices {[str(d) for d in jax.devices()]}")
    table, notes = {}, []
    for compiler in args.compilers:
        counts: collections.Counter[str] = collections.Counter()
        started = time.perf_counter()
        for case in cases:
            outcome, detail = corpus["run"](case, compiler, **options.get(compiler, {}))
            counts[outcome] += 1
            if outcome != "agree":
                notes.append(f"- {compiler} {case.name}: {outcome}: {detail.splitlines()[0][:200] if detail else ''}")
        table[compiler] = (counts, time.perf_counter() - started)
    print()
    print("| compiler | options | " + " | ".join(OUTCOMES) + " | seconds |")
    print("|---|---|" + "---|" * len(OUTCOMES) + "---|")
    for compiler, (counts, seconds) in table.items():
        shown = ", ".join(f"{k}={v}" for k, v in options.get(compiler, {}).items()) or "defaults"
        print(f"| {compiler} | {shown} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + f" | {seconds:.0f} |")
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
