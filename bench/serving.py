"""Dynamic batching against the raw compiled function, and against Ray Serve.

In one run, on an MLP (256 -> 1024 -> 256, float32, ReLU) compiled with XLA:

1. raw: the compiled batch-64 executable called back to back (rows/s);
2. served: 64 concurrent single-row callers, as asyncio tasks through
   ``js.batched_run_async`` (how the network front calls it) and as threads
   through ``js.batched_run`` (rows/s as a fraction of raw; goal >= 0.80),
   p50/p99 latency and the mean executed batch size; and the same callers
   through a bare Python batcher (a future or a lock per caller and one
   compiled call per batch, nothing else), the ceiling of a Python server that
   runs one batch at a time on this machine, with jitserve's throughput as a
   fraction of it;
3. padding waste with random request sizes 1..batch_size (goal <= 25%);
4. the same 64 single-row callers through Ray Serve's ``@serve.batch`` on the
   same jitted function (needs ``pip install 'jitserve[bench]'``; skipped
   otherwise);
5. the adaptive batching window: p50 latency of one caller sending 1-row
   requests, with the window adaptive (the default) and fixed, against calling
   the compiled batch-1 function directly and against an unbatched server
   (batch size 1, no window: the direct call plus the thread hop, this
   in-process transport; goal: adaptive p50 <= 1.2x the unbatched server's),
   and 64 asyncio callers' throughput with the adaptive window against the
   fixed one (goal: not lower);
6. streaming: a 1,000-row request through ``js.batched_stream``: time to its
   first rows against one batch-64 execution and against the whole request
   (goal: the first rows arrive after about one batch's time);
7. one batch-64 call back to back (how raw is measured) against the same call
   1 ms after the last, and a served batch's execution time: a server whose
   callers all wait on one batch starts every batch after an idle spell;
8. input buffers: a batch of 64 images (3x224x224 float32) through an
   executor that writes every batch into new arrays (``Serving.run``'s)
   against one that reuses its input buffer (a server partition's).

XLA's CPU computations run inline on the partition that calls them, as
``jitserve serve`` runs them (``--cpu-dispatch async``: on XLA's dispatch
thread, JAX's default), for the raw function and the servers alike.

The batch size (and so the number of callers) is 64 unless
``JITSERVE_BENCH_BATCH`` says otherwise: on a GPU the goal is served / raw at
batch 512 (``JITSERVE_BENCH_BATCH=512``).

    python3 dev.py bench serving
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import queue
import random
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js
from jitserve.compilers.xla import run_cpu_computations_inline
from jitserve.loadtest import closed_loop, closed_loop_async
from jitserve.serving.serving import Executor

BATCH = int(os.environ.get("JITSERVE_BENCH_BATCH", "64"))
rng = np.random.default_rng(0)
W1 = rng.normal(0, 0.05, (256, 1024)).astype(np.float32)
W2 = rng.normal(0, 0.05, (1024, 256)).astype(np.float32)


def mlp(x):
    return jnp.maximum(x @ W1, 0.0) @ W2


def raw_rows_per_s(seconds: float) -> float:
    compiled = js.compile(mlp, [js.template((BATCH, 256), "float32")])
    x = rng.normal(size=(BATCH, 256)).astype(np.float32)
    np.asarray(compiled(x))
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.asarray(compiled(x))
        calls += 1
    return calls * BATCH / (time.perf_counter() - start)


def call_p50(rows: int, idle: float = 0.0, calls: int = 400) -> float:
    """Median time of one call of the compiled function for ``rows`` rows, each call ``idle`` seconds after
    the last (0: back to back). At 1 row: the floor a served 1-row request sits on. At 64 rows with an idle
    spell: a server whose callers all wait on the same batch calls XLA only after they have all come back,
    so its compute always starts after one; this measures what that alone costs on this machine."""
    compiled = js.compile(mlp, [js.template((rows, 256), "float32")])
    x = rng.normal(size=(rows, 256)).astype(np.float32)
    times = []
    for _ in range(calls):
        if idle:
            time.sleep(idle)
        started = time.perf_counter()
        np.asarray(compiled(x))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def input_buffers(calls: int = 15) -> dict[bool, float]:
    """Median time of one batch of 64 one-image pieces (3x224x224 float32, 38 MB; the function a mean, so
    that moving the rows dominates) through an executor that writes each batch into new arrays, as
    ``Serving.run`` does, and through one that reuses its input buffer, as a server's partitions do."""
    serving = js.Serving(lambda x: x.mean(axis=(1, 2, 3)), batch_size=BATCH, batch_sizes=[BATCH])
    images = [rng.random((1, 3, 224, 224), np.float32) for _ in range(BATCH)]
    batch = js.Batch.concatenate(images)
    times: dict[bool, list[float]] = {False: [], True: []}
    executors = {reuse: Executor(serving, serving.partition_options()[0], lambda: None, reuse_inputs=reuse)
                 for reuse in (False, True)}
    for _ in range(calls):
        for reuse, executor in executors.items():  # alternating: this machine's speed drifts
            started = time.perf_counter()
            executor.execute(batch, ())  # no weights: this serving has no params
            times[reuse].append(time.perf_counter() - started)
    return {reuse: statistics.median(spent[2:]) for reuse, spent in times.items()}  # the first ones compile


def served(seconds: float, batch_timeout: float, sizes, name: str, use_async: bool = False,
           partitions: int = 1, adaptive: bool = True, callers: int = BATCH, batch_size: int = BATCH) -> dict:
    serving = js.Serving(mlp, batch_size=batch_size, batch_timeout=batch_timeout, partitions=partitions,
                         adaptive=adaptive, input_template=js.template((256,), "float32"))

    def make_call(seed: int):
        local = random.Random(seed)
        x = np.random.default_rng(seed).normal(size=(BATCH, 256)).astype(np.float32)

        def call() -> int:
            n = sizes(local)
            assert js.batched_run(name, js.Batch.concatenate([x[:n]])).shape == (n, 256)
            return n

        async def call_async() -> int:
            assert (await js.batched_run_async(name, js.Batch.concatenate([x[:1]]))).shape == (1, 256)
            return 1

        return call_async if use_async else call

    with js.serve(serving, name=name) as server:
        load = (closed_loop_async if use_async else closed_loop)(make_call, callers, seconds)
        stats = server.stats()
    executed = sum(size * count for size, count in stats.batch_sizes.items())
    return {
        "rows_per_s": load.rows_per_s, "p50": load.percentile(50), "p99": load.percentile(99),
        "mean_batch": stats.rows / stats.batches, "waste": stats.padded_rows / executed,
        "compiles": stats.compiles,
        "full_batch_s": (stats.batch_phases[batch_size].total_s / stats.batch_sizes[batch_size]
                         if batch_size in stats.batch_sizes else math.nan),
    }


def bare_batcher(seconds: float, use_async: bool) -> float:
    """rows/s of the least any Python batcher does, driven by the same load harness: 64 one-row callers, a
    future (asyncio) or a lock (threads) each, one concatenate and one compiled batch-64 call per batch, and
    nothing else (no queue per signature, no validation, no timeouts, no statistics). The ceiling of the
    in-process goal for a server that runs one batch at a time on this machine: what the interpreter itself
    costs per caller and hand-off."""
    compiled = js.compile(mlp, [js.template((BATCH, 256), "float32")])
    rows = rng.normal(size=(BATCH, 256)).astype(np.float32)
    padding = np.zeros((BATCH, 256), np.float32)

    def run(batch_rows: list[np.ndarray]) -> np.ndarray:
        return np.asarray(compiled(np.concatenate(batch_rows + [padding[:BATCH - len(batch_rows)]])))

    if use_async:
        pending: list = []
        timer: list[asyncio.TimerHandle] = []  # the window of the batch being gathered

        def flush() -> None:
            if timer:
                timer.pop().cancel()
            items = pending[:]
            pending.clear()
            if items:
                out = run([row for row, _ in items])  # on the loop itself: no hand-off at all
                for i, (_, future) in enumerate(items):
                    future.set_result(out[i:i + 1])

        def make_async(seed: int):
            row = rows[seed % BATCH:seed % BATCH + 1]

            async def call() -> int:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                pending.append((row, future))
                if len(pending) == BATCH:
                    flush()
                elif len(pending) == 1:
                    timer.append(loop.call_later(0.002, flush))
                assert (await future).shape == (1, 256)
                return 1
            return call

        return closed_loop_async(make_async, BATCH, seconds).rows_per_s

    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def batcher() -> None:
        while not stop.is_set():
            try:
                items = [arrivals.get(timeout=0.1)]
            except queue.Empty:
                continue
            deadline = time.monotonic() + 0.002
            while len(items) < BATCH and (left := deadline - time.monotonic()) > 0:
                try:
                    items.append(arrivals.get(timeout=left))
                except queue.Empty:
                    break
            out = run([row for row, _, _ in items])
            for i, (_, done, box) in enumerate(items):
                box.append(out[i:i + 1])
                done.release()

    def make_call(seed: int):
        row = rows[seed % BATCH:seed % BATCH + 1]

        def call() -> int:
            done, box = threading.Lock(), []
            done.acquire()
            arrivals.put((row, done, box))
            done.acquire()
            assert box[0].shape == (1, 256)
            return 1
        return call

    thread = threading.Thread(target=batcher, daemon=True)
    thread.start()
    try:
        return closed_loop(make_call, BATCH, seconds).rows_per_s
    finally:
        stop.set()
        thread.join()


def streaming_first_rows(batch_timeout: float, rows: int = 1000) -> dict:
    """Time to the first rows of a ``rows``-row request through batched_stream, against the whole request."""
    serving = js.Serving(mlp, batch_size=BATCH, batch_timeout=batch_timeout,
                         input_template=js.template((256,), "float32"))
    x = rng.normal(size=(rows, 256)).astype(np.float32)
    compiled = js.compile(mlp, [js.template((BATCH, 256), "float32")])
    one_batch = min((lambda t0: (np.asarray(compiled(x[:BATCH])), time.perf_counter() - t0)[1])(time.perf_counter())
                    for _ in range(20))
    firsts, wholes = [], []
    with js.serve(serving, name="mlp-stream"):
        for _ in range(10):
            started = time.perf_counter()
            stream = js.batched_stream("mlp-stream", js.Batch.concatenate([x]))
            first = next(stream)
            firsts.append(time.perf_counter() - started)
            got = first.shape[0] + sum(part.shape[0] for part in stream)
            wholes.append(time.perf_counter() - started)
            assert got == rows
    return {"first": statistics.median(firsts), "whole": statistics.median(wholes), "batch": one_batch,
            "first_rows": first.shape[0]}


def ray_serve(seconds: float, batch_timeout: float) -> dict | None:
    try:
        import ray
        from ray import serve
    except Exception as error:
        print(f"Ray Serve unavailable here: {type(error).__name__}: {str(error)[:200]}")
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    jitted = jax.jit(mlp)

    @serve.deployment(max_ongoing_requests=BATCH * 2)
    class MLP:
        @serve.batch(max_batch_size=BATCH, batch_wait_timeout_s=batch_timeout)
        async def __call__(self, rows: list[np.ndarray]) -> list[np.ndarray]:
            out = np.asarray(jitted(np.concatenate(rows)))
            return [out[i:i + 1] for i in range(len(rows))]

    handle = serve.run(MLP.bind(), name="mlp", route_prefix=None)
    handle.remote(np.zeros((1, 256), np.float32)).result()

    def make_call(seed: int):
        x = np.random.default_rng(seed).normal(size=(1, 256)).astype(np.float32)
        return lambda: (handle.remote(x).result(), 1)[1]

    try:
        load = closed_loop(make_call, BATCH, seconds)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"rows_per_s": load.rows_per_s, "p50": load.percentile(50), "p99": load.percentile(99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured run")
    parser.add_argument("--batch-timeout", type=float, default=0.002)
    parser.add_argument("--partitions", type=int, default=1, help="partitions for the asyncio run")
    parser.add_argument("--cpu-dispatch", choices=["inline", "async"], default="inline",
                        help="XLA's CPU computations run inline on the calling thread, as jitserve serve runs them "
                        "(default), or are handed to XLA's dispatch thread (JAX's default); raw and served alike")
    args = parser.parse_args()
    if args.cpu_dispatch == "inline":
        run_cpu_computations_inline()

    raws = [raw_rows_per_s(args.seconds / 2)]
    single_async = served(args.seconds, args.batch_timeout, lambda r: 1, "mlp-async", use_async=True,
                          partitions=args.partitions)
    raws.append(raw_rows_per_s(args.seconds / 2))
    single = served(args.seconds, args.batch_timeout, lambda r: 1, "mlp-single")
    raws.append(raw_rows_per_s(args.seconds / 2))
    mixed = served(args.seconds, args.batch_timeout, lambda r: r.randint(1, BATCH), "mlp-mixed")
    raws.append(raw_rows_per_s(args.seconds / 2))
    bare = {use_async: bare_batcher(args.seconds, use_async) for use_async in (True, False)}
    raws.append(raw_rows_per_s(args.seconds / 2))
    raw = statistics.mean(raws)  # measured between the runs: this machine's speed drifts
    ray_result = ray_serve(args.seconds, args.batch_timeout)

    print(f"MLP 256->1024->256 float32, XLA on {jax.devices()[0].device_kind} (CPU computations "
          f"{'inline' if args.cpu_dispatch == 'inline' else 'on XLA dispatch thread'}), batch_size {BATCH}, "
          f"batch_timeout {args.batch_timeout * 1e3:g} ms, {BATCH} closed-loop callers, {args.seconds:g} s per run")
    print("| run | rows/s | vs raw | vs bare batcher | p50 ms | p99 ms | mean batch | padding waste |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| raw compiled batch-{BATCH} (mean of {len(raws)} runs between the others) | {raw:,.0f} | 1.00 "
          f"| | | | {BATCH} | |")
    for use_async, label in [(True, "asyncio callers"), (False, "threads")]:
        print(f"| bare Python batcher, 1-row requests, {label} (the ceiling: see bare_batcher) "
              f"| {bare[use_async]:,.0f} | {bare[use_async] / raw:.2f} | 1.00 | | | | |")
    for label, r, floor in [("jitserve, 1-row requests, asyncio callers", single_async, bare[True]),
                            ("jitserve, 1-row requests, threads", single, bare[False]),
                            (f"jitserve, 1..{BATCH}-row requests, threads", mixed, None)]:
        vs_bare = "" if floor is None else f"{r['rows_per_s'] / floor:.2f}"
        print(f"| {label} | {r['rows_per_s']:,.0f} | {r['rows_per_s'] / raw:.2f} | {vs_bare} | {r['p50'] * 1e3:.2f} "
              f"| {r['p99'] * 1e3:.2f} | {r['mean_batch']:.1f} | {100 * r['waste']:.1f}% |")
    if ray_result is None:
        print("| Ray Serve @serve.batch | unavailable (see above; pip install 'jitserve[bench]') | | | | | | |")
    else:
        print(f"| Ray Serve @serve.batch, 1-row requests | {ray_result['rows_per_s']:,.0f} "
              f"| {ray_result['rows_per_s'] / raw:.2f} | | {ray_result['p50'] * 1e3:.2f} "
              f"| {ray_result['p99'] * 1e3:.2f} | | |")
    print(f"compiles per served run: {single_async['compiles']}, {single['compiles']}, {mixed['compiles']} "
          f"(all at warm-up: {len(js.Serving(mlp, batch_size=BATCH).batch_sizes)} batch sizes)")

    back_to_back, after_idle = call_p50(BATCH), call_p50(BATCH, idle=0.001)
    print(f"one batch-{BATCH} call, median: {back_to_back * 1e3:.2f} ms back to back, {after_idle * 1e3:.2f} ms "
          f"1 ms after the last ({back_to_back / after_idle:.2f} of raw's rate); a served batch of {BATCH} "
          f"(asyncio callers) took {single_async['full_batch_s'] * 1e3:.2f} ms to execute: with every caller "
          f"waiting on the same batch, the compute starts after an idle spell")

    buffers = input_buffers()
    print(f"a batch of {BATCH} images (3x224x224 float32) through a partition's executor: "
          f"{buffers[False] * 1e3:.1f} ms written into new arrays, {buffers[True] * 1e3:.1f} ms into its reused input "
          f"buffer ({buffers[False] / buffers[True]:.2f}x)")

    direct = call_p50(1, calls=2000)
    one = {adaptive: served(args.seconds / 2, args.batch_timeout, lambda r: 1, f"mlp-one-{adaptive}",
                            adaptive=adaptive, callers=1) for adaptive in (True, False)}
    unbatched = served(args.seconds / 2, 0.0, lambda r: 1, "mlp-unbatched", callers=1, batch_size=1)
    fixed_async = served(args.seconds, args.batch_timeout, lambda r: 1, "mlp-async-fixed", use_async=True,
                         partitions=args.partitions, adaptive=False)
    print()
    print(f"adaptive batching window (batch_timeout {args.batch_timeout * 1e3:g} ms):")
    print("| run | p50 ms | vs direct call | rows/s |")
    print("|---|---|---|---|")
    print(f"| compiled batch-1 function called directly | {direct * 1e3:.3f} | 1.00 | |")
    print(f"| 1 caller, unbatched server (batch_size 1, batch_timeout 0) | {unbatched['p50'] * 1e3:.3f} "
          f"| {unbatched['p50'] / direct:.2f} | {unbatched['rows_per_s']:,.0f} |")
    for adaptive, label in [(True, "adaptive (default)"), (False, "fixed window (adaptive=False)")]:
        r = one[adaptive]
        print(f"| 1 caller, 1-row requests, {label} | {r['p50'] * 1e3:.3f} | {r['p50'] / direct:.2f} "
              f"({r['p50'] / unbatched['p50']:.2f}x unbatched) | {r['rows_per_s']:,.0f} |")
    print(f"| {BATCH} asyncio callers, adaptive / fixed throughput | | | "
          f"{single_async['rows_per_s']:,.0f} / {fixed_async['rows_per_s']:,.0f} = "
          f"{single_async['rows_per_s'] / fixed_async['rows_per_s']:.2f} |")

    stream = streaming_first_rows(args.batch_timeout)
    print()
    print(f"streaming a 1,000-row request (batch {BATCH}; median of 10):")
    print(f"| one batch-{BATCH} execution ms | first rows ms | whole request ms | first / whole |")
    print("|---|---|---|---|")
    print(f"| {stream['batch'] * 1e3:.2f} | {stream['first'] * 1e3:.2f} ({stream['first_rows']} rows) "
          f"| {stream['whole'] * 1e3:.2f} | {stream['first'] / stream['whole']:.2f} |")


if __name__ == "__main__":
    main()
