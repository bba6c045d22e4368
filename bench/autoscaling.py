"""Autoscaling reaction: jitserve's autoscaler against Ray Serve's, on the same load, model and bounds.

A model that takes 0.3 s per request, one request at a time per replica, between 1 and 3 replicas, on a
local Ray instance (loopback). Load: ``--callers`` threads calling it back to back for ``--load``
seconds, then none for ``--idle`` seconds. Every second the replicas that serve are counted (Ray Serve's
``serve.status()``, asked 4 times a second, starves its controller: it then never scales up at all). Printed per
system: seconds from the start of the load until 3 replicas serve, from its end until 1 does, and how
often the count turned from rising to falling or back (flaps; 1 is the least a rise and a fall take).

Ray Serve runs twice: with its defaults (the anchor: ``target_ongoing_requests=2``, a 10 s metrics
interval, a 30 s look-back, ``upscale_delay_s=30``, ``downscale_delay_s=600``), and tuned to react as
fast as it lets (``metrics_interval_s=0.25``, ``look_back_period_s=1``, ``upscale_delay_s=1``,
``downscale_delay_s=10``, ``target_ongoing_requests=1``). jitserve runs with its defaults
(``Autoscaling(1, 3)``: upscale after 1 s, downscale after 10 s, a target of one batch waiting).

    python3 dev.py bench autoscaling        # about 4 minutes; needs the bench extra (ray[serve])
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
import ray

import jitserve as js
from jitserve.cluster import ray as cluster

SECONDS_PER_REQUEST = 0.3


def slow(x: np.ndarray) -> np.ndarray:
    time.sleep(SECONDS_PER_REQUEST)
    return x * 2 + 1


def drive(call: Callable[[], object], count: Callable[[], int], callers: int, load_s: float,
          idle_s: float) -> dict[str, object]:
    """Load for ``load_s`` then idle for ``idle_s``; the replica counts seen, and when."""
    stop = threading.Event()
    failures = []

    def caller() -> None:
        while not stop.is_set():
            try:
                call()
            except Exception as error:  # counted, reported
                failures.append(repr(error))

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(callers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    seen = []
    ended = None
    while time.monotonic() - started < load_s + idle_s:
        now = time.monotonic() - started
        if ended is None and now >= load_s:
            stop.set()
            ended = now
        seen.append((now, count()))
        time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(30)
    up = next((t for t, n in seen if n == 3), None)
    down = next((t - load_s for t, n in seen if t >= load_s and n == 1), None)
    counts = [n for _, n in seen]
    turns, direction = 0, 0
    for before, after in itertools.pairwise(counts):
        step = (after > before) - (after < before)
        if step and direction and step != direction:
            turns += 1
        direction = step or direction
    return {"up": up, "down": down, "turns": turns, "failures": len(failures), "counts": counts}


def run_jitserve(args: argparse.Namespace) -> dict[str, object]:
    serving = js.Serving(slow, batch_size=1, batch_timeout=0, compiler="eager")
    handle = js.serve(serving, name="elastic", cluster="ray",
                      autoscaling=cluster.Autoscaling(min_replicas=1, max_replicas=3))
    x = js.Batch.concatenate([np.ones((1, 4), np.float32)])
    try:
        return drive(lambda: js.batched_run("elastic", x, timeout=60), lambda: len(handle.replicas), args.callers,
                     args.load, args.idle)
    finally:
        handle.stop()


def run_ray_serve(args: argparse.Namespace, config: dict[str, float]) -> dict[str, object]:
    from ray import serve

    @serve.deployment(max_ongoing_requests=1, ray_actor_options={"num_cpus": 0},
                      autoscaling_config={"min_replicas": 1, "max_replicas": 3, **config})
    class Slow:
        def __call__(self, x: np.ndarray) -> np.ndarray:
            return slow(x)

    handle = serve.run(Slow.bind(), name="elastic", route_prefix=None)
    x = np.ones((1, 4), np.float32)

    def running() -> int:
        deployment = serve.status().applications["elastic"].deployments["Slow"]
        return deployment.replica_states.get("RUNNING", 0)

    try:
        return drive(lambda: handle.remote(x).result(timeout_s=60), running, args.callers, args.load, args.idle)
    finally:
        serve.delete("elastic")


def shown(seconds: object) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--load", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--idle", type=float, default=40.0, help="seconds without load after it")
    parser.add_argument("--systems", nargs="*", default=["jitserve", "ray-serve", "ray-serve-tuned"])
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    systems = {"jitserve": ("jitserve (defaults)", lambda: run_jitserve(args)),
               "ray-serve": ("Ray Serve (defaults)", lambda: run_ray_serve(args, {})),
               "ray-serve-tuned": ("Ray Serve (tuned)", lambda: run_ray_serve(args, {
                   "target_ongoing_requests": 1, "metrics_interval_s": 0.25, "look_back_period_s": 1,
                   "upscale_delay_s": 1, "downscale_delay_s": 10}))}
    if importlib.util.find_spec("ray.serve") is None:
        print("Ray Serve is not installed (pip install '.[bench]'); measuring jitserve alone")
        args.systems = [system for system in args.systems if system == "jitserve"]
    runs = [systems[system] for system in args.systems]
    print(f"{args.callers} callers of a {SECONDS_PER_REQUEST} s model for {args.load:.0f} s, then "
          f"{args.idle:.0f} s idle; replicas 1..3")
    print("| system | to 3 replicas after the load began | to 1 after it ended | turns | failed requests |")
    print("|---|---|---|---|---|")
    for label, run in runs:
        result = run()
        print(f"| {label} | {shown(result['up'])} | {shown(result['down'])} | {result['turns']} | "
              f"{result['failures']} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
