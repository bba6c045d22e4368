"""jitserve through Ray against jitserve in process and against Ray Serve's ``@serve.batch``.

In one run, on the MLP of ``bench/serving.py`` (256 -> 1024 -> 256, float32,
XLA), batch_size 64, batch_timeout 2 ms, CALLERS closed-loop threads sending
1-row requests:

1. in process: ``js.serve`` + ``js.batched_run`` (the baseline);
2. through Ray: the same Serving as REPLICAS replica actors on a local Ray
   cluster, called by name from this driver (callers coalesced into one Ray
   call per batch); goal >= 0.5x in process;
3. Ray Serve: a deployment whose ``@serve.batch`` method runs the same jitted
   function, called through its handle; goal: jitserve through Ray >= 10x it.

Every answer's shape is checked. ``--gpus 1`` puts one replica per GPU
(``num_gpus=1``) and runs the in-process baseline on the GPU too.

    python3 dev.py bench ray_serve  # needs pip install 'jitserve[bench]' for Ray Serve
"""

from __future__ import annotations

import argparse
import os
import runpy
import tempfile
from pathlib import Path

import jax
import numpy as np

import jitserve as js
from jitserve.loadtest import closed_loop

# the very MLP of bench/serving.py (bench/ is not on sys.path: scripts run with -P)
_SERVING_BENCH = runpy.run_path(str(Path(__file__).with_name("serving.py")))
BATCH = _SERVING_BENCH["BATCH"]
mlp = _SERVING_BENCH["mlp"]


def one_row_calls(run):
    def make_call(seed: int):
        x = np.random.default_rng(seed).normal(size=(1, 256)).astype(np.float32)

        def call() -> int:
            assert run(x).shape == (1, 256)
            return 1

        return call

    return make_call


def serving(batch_timeout: float) -> js.Serving:
    return js.Serving(mlp, batch_size=BATCH, batch_timeout=batch_timeout, input_template=js.template((256,), "float32"))


def in_process(args) -> dict:
    with js.serve(serving(args.batch_timeout), name="mlp-local") as server:
        load = closed_loop(one_row_calls(lambda x: js.batched_run("mlp-local", js.Batch.concatenate([x]))),
                           args.callers, args.seconds)
        stats = server.stats()
    return {"load": load, "mean_batch": stats.rows / stats.batches}


def through_ray(args) -> dict:
    options = {"num_gpus": 1} if args.gpus else {}
    handle = js.serve(serving(args.batch_timeout), name="mlp", cluster="ray", replicas=args.replicas, **options)
    try:
        load = closed_loop(one_row_calls(lambda x: js.batched_run(("ray", "mlp"), js.Batch.concatenate([x]))),
                           args.callers, args.seconds)
        stats = handle.stats().total  # every Ray call is one request on a replica
    finally:
        handle.stop()
    return {"load": load, "mean_batch": stats.rows / stats.batches, "rows_per_call": stats.rows / stats.requests}


def ray_serve(args) -> dict | None:
    try:
        from ray import serve
    except Exception as error:
        print(f"Ray Serve unavailable here: {type(error).__name__}: {str(error)[:200]}")
        return None
    jitted = jax.jit(mlp)

    @serve.deployment(max_ongoing_requests=BATCH * 2, ray_actor_options={"num_gpus": 1} if args.gpus else {})
    class MLP:
        @serve.batch(max_batch_size=BATCH, batch_wait_timeout_s=args.batch_timeout)
        async def __call__(self, rows: list[np.ndarray]) -> list[np.ndarray]:
            out = np.asarray(jitted(np.concatenate(rows)))
            return [out[i:i + 1] for i in range(len(rows))]

    handle = serve.run(MLP.bind(), name="mlp-serve", route_prefix=None)
    handle.remote(np.zeros((1, 256), np.float32)).result()
    try:
        load = closed_loop(one_row_calls(lambda x: handle.remote(x).result()), args.callers, args.seconds)
    finally:
        serve.shutdown()
    return {"load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured run")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--batch-timeout", type=float, default=0.002)
    parser.add_argument("--gpus", type=int, default=0, help="1: one replica per GPU (num_gpus=1)")
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="jitserve-bench-ray-"))
    local = in_process(args)
    ray.init(num_cpus=max(os.cpu_count() or 2, 4), num_gpus=args.gpus or None, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    try:
        remote = through_ray(args)
        peer = ray_serve(args)
    finally:
        ray.shutdown()

    base = local["load"].rows_per_s
    device = jax.devices()[0].device_kind
    print(f"MLP 256->1024->256 float32, XLA on {device}, batch_size {BATCH}, batch_timeout "
          f"{args.batch_timeout * 1e3:g} ms, {args.callers} closed-loop threads x 1-row requests, {args.seconds:g} s "
          f"per run, {args.replicas} replica(s){' with num_gpus=1' if args.gpus else ''}")
    print("| run | rows/s | vs in process | p50 ms | p99 ms | mean replica batch |")
    print("|---|---|---|---|---|---|")
    rows = [("jitserve in process", local["load"], f"{local['mean_batch']:.1f}"),
            ("jitserve through Ray (coalesced)", remote["load"],
             f"{remote['mean_batch']:.1f} ({remote['rows_per_call']:.1f} rows per Ray call)")]
    if peer is not None:
        rows.append(("Ray Serve @serve.batch", peer["load"], ""))
    for label, load, batch in rows:
        print(f"| {label} | {load.rows_per_s:,.0f} | {load.rows_per_s / base:.2f} | {load.percentile(50) * 1e3:.2f} "
              f"| {load.percentile(99) * 1e3:.2f} | {batch} |")
    ratio = remote["load"].rows_per_s / base
    print(f"jitserve through Ray / in process: {ratio:.2f} (goal >= 0.5: {'met' if ratio >= 0.5 else 'NOT met'})")
    if peer is not None:
        versus = remote["load"].rows_per_s / peer["load"].rows_per_s
        print(f"jitserve through Ray / Ray Serve @serve.batch: {versus:.1f}x (goal >= 10x: "
              f"{'met' if versus >= 10 else 'NOT met'})")


if __name__ == "__main__":
    main()
