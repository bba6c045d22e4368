"""Weights as runtime params against weights closed over as constants, on a 200 MB model.

The model is 12 dense 2048 x 2048 float32 layers with tanh (50 M parameters, 201 MB), served with
``batch_size=64`` (7 compiled batch sizes). Each configuration runs in a fresh process, so that its
peak RSS is its own:

- ``params``: ``js.Serving(model, params=weights)``, the weights resident runtime inputs;
- ``jax``: ``jax.jit(model)`` with the weights as an argument, compiled for the same 7 sizes (the
  baseline: what a user of JAX alone would do);
- ``closure``: ``js.Serving(lambda x: model(weights, x))``, the weights compiled in as constants.

For each: warm-up (placing the weights and compiling the 7 sizes), peak RSS, and throughput at batch 64
(rows/s through a running server; for ``jax``, the jitted call). Goals: warm-up and peak RSS of
``params`` within 1.5x of ``jax``'s, throughput within 1.05x of ``closure``'s. Then IREE: compiling
the served model at 2 batch sizes with 201 MB of weights against the same 12 layers at width 144
(1 MB): compile time should not grow with the weights (goal: within 2x).

    python3 dev.py bench params [--calls 40] [--skip-closure] [--skip-iree]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

LAYERS = 12
WIDTH = 2048
BATCH = 64


def weights(width: int = WIDTH, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"layers": [{"w": (rng.standard_normal((width, width), np.float32) / np.float32(np.sqrt(width))),
                        "b": np.zeros(width, np.float32)} for _ in range(LAYERS)]}


def model(params, x):
    import jax.numpy as jnp

    for layer in params["layers"]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(kind: str, calls: int) -> dict:
    """Run one configuration in this process; its figures as a dict."""
    from jitserve.compilers.xla import run_cpu_computations_inline

    run_cpu_computations_inline()  # as jitserve serve does, for every configuration alike
    import jax

    import jitserve as js

    params = weights()
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH), np.float32)
    started = time.perf_counter()
    if kind == "jax":
        jitted = jax.jit(model)
        resident = jax.device_put(params)
        for size in [1, 2, 4, 8, 16, 32, 64]:
            jitted.lower(resident, jax.ShapeDtypeStruct((size, WIDTH), np.float32)).compile()
        warm_up = time.perf_counter() - started
        run = lambda: np.asarray(jitted(resident, x))  # noqa: E731
    else:
        template = js.template((WIDTH,), "float32")
        serving = (js.Serving(model, params=params, batch_size=BATCH, input_template=template) if kind == "params"
                   else js.Serving(lambda rows: model(params, rows), batch_size=BATCH, input_template=template))
        js.serve(serving, name=kind)  # runs until this process ends
        warm_up = time.perf_counter() - started
        batch = js.Batch.concatenate([x])
        run = lambda: js.batched_run(kind, batch)  # noqa: E731
    run()
    started = time.perf_counter()
    for _ in range(calls):
        run()
    rows_per_s = calls * BATCH / (time.perf_counter() - started)
    return {"warm_up_s": warm_up, "peak_rss_mb": peak_rss_mb(), "rows_per_s": rows_per_s}


def iree_compile_s(width: int) -> float:
    """Seconds to compile the served model for 2 batch sizes with IREE, its weights as params."""
    import jitserve as js

    serving = js.Serving(model, params=weights(width), batch_size=2, input_template=js.template((width,), "float32"),
                         compiler="iree")
    started = time.perf_counter()
    with js.serve(serving, name=f"iree{width}"):
        return time.perf_counter() - started


def in_child(*arguments: str) -> dict:
    done = subprocess.run([sys.executable, "-P", __file__, *arguments], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="batches of 64 rows timed per configuration")
    parser.add_argument("--skip-closure", action="store_true", help="leave out the (slow) closure configuration")
    parser.add_argument("--skip-iree", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--iree-width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.calls)))
        return
    if args.iree_width:
        print(json.dumps({"compile_s": iree_compile_s(args.iree_width)}))
        return

    kinds = ["jax", "params"] + ([] if args.skip_closure else ["closure"])
    results = {kind: in_child("--one", kind, "--calls", str(args.calls)) for kind in kinds}
    print(f"{LAYERS} dense {WIDTH}x{WIDTH} float32 layers ({LAYERS * WIDTH * (WIDTH + 1) * 4 / 1e6:.0f} MB), "
          f"batch_size {BATCH} (7 compiled sizes), XLA on the CPU, each in a fresh process:")
    print("| configuration | warm-up | peak RSS | rows/s at batch 64 |")
    print("|---|---|---|---|")
    for kind, figures in results.items():
        print(f"| {kind} | {figures['warm_up_s']:.2f} s | {figures['peak_rss_mb']:,.0f} MB | "
              f"{figures['rows_per_s']:,.0f} |")
    jax_, ours = results["jax"], results["params"]
    print(f"params / jax: warm-up {ours['warm_up_s'] / jax_['warm_up_s']:.2f}x, "
          f"peak RSS {ours['peak_rss_mb'] / jax_['peak_rss_mb']:.2f}x (goal: <= 1.5x each)")
    if "closure" in results:
        closure = results["closure"]
        print(f"closure / params: warm-up {closure['warm_up_s'] / ours['warm_up_s']:.1f}x, "
              f"peak RSS {closure['peak_rss_mb'] / ours['peak_rss_mb']:.1f}x; throughput params / closure "
              f"{ours['rows_per_s'] / closure['rows_per_s']:.3f}x (goal: >= 0.95)")
    if not args.skip_iree:
        big, small = (in_child("--iree-width", str(width))["compile_s"] for width in (WIDTH, 144))
        print(f"IREE, 2 batch sizes, weights as params: {big:.2f} s with {LAYERS * WIDTH * WIDTH * 4 / 1e6:.0f} MB, "
              f"{small:.2f} s with {LAYERS * 144 * 144 * 4 / 1e6:.1f} MB: {big / small:.2f}x (goal: <= 2x)")


if __name__ == "__main__":
    main()
