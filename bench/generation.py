"""Continuous batching (js.Generation) against request-level batching and one request at a time.

The model is ``examples/gpt2.py`` (the small config unless ``JITSERVE_GPT2=full``): greedy decoding
with its KV cache. 64 requests (``--requests``), each with a random prompt of 1..32 tokens and an
output length drawn uniformly from 1..256 (fixed seed), arrive in a Poisson stream (``--rate`` per
second). Three servers, the same slots / batch size (``--slots``):

- ``generation``: ``js.Generation(prefill, decode, slots=...)``, admitting requests between steps;
- ``streaming``: today's ``js.Serving(..., streaming=True)`` whose generator prefills a batch and
  decodes it until its longest request is done (each request reads its own outputs, then leaves), the
  same jitted prefill and decode inside; a batch holds its rows to its end;
- ``one at a time``: ``js.Generation`` with one slot.

For each: outputs per second (all outputs over the time from the first arrival to the last output),
p50 / p99 time to first output, p50 / p99 time per output step (a request's time from its first to
its last output over its outputs after the first). Goals: generation >= 3x the outputs/s of
streaming, and its p99 time to first output below streaming's p50.

    python3 dev.py bench generation [--requests 64] [--rate 200] [--slots 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def gpt2():
    spec = importlib.util.spec_from_file_location("example_gpt2", EXAMPLES / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(requests: int, rate: float, vocab: int, context: int, seed: int = 0):
    """(arrival offset in seconds, prompt, output length) per request."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, requests))
    return [(float(at), rng.integers(1, vocab, int(rng.integers(1, context + 1))).astype(np.int32),
             int(rng.integers(1, 257))) for at in arrivals]


def streaming_serving(module, slots: int) -> js.Serving:
    """Request-level batching: a generator over one batch of prompts, decoding until its longest is done."""
    def greedy(step):  # the example's functions give logits; the server's greedy pick is an argmax
        def picked(*arguments):
            state, logits = step(*arguments)
            return state, jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return picked

    many_prefill = jax.jit(greedy(jax.vmap(module.prefill, in_axes=(None, 0, 0))))
    decode = jax.jit(greedy(module.decode), donate_argnums=1)
    params = jax.device_put(module.load())

    def generate(entry):
        state, tokens = many_prefill(params, jnp.asarray(entry["tokens"]), jnp.asarray(entry["length"]))
        yield np.asarray(tokens)
        for _ in range(int(np.max(entry["steps"])) - 1):
            state, tokens = decode(params, state, tokens)
            yield np.asarray(tokens)

    return js.Serving(generate, streaming=True, batch_size=slots, batch_sizes=[slots], batch_timeout=0.005)


def drive(call, requests) -> dict:
    """Start each request at its arrival time on its own thread; ``call(prompt, steps, record)`` records the
    time of each output. Returns the figures."""
    times: list[list[float]] = [[] for _ in requests]
    submitted = [0.0] * len(requests)
    start = time.perf_counter() + 0.05

    def one(index, at, prompt, steps):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        submitted[index] = time.perf_counter()
        call(prompt, steps, times[index].append)

    threads = [threading.Thread(target=one, args=(i, *request)) for i, request in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(len(t) == steps for t, (_, _, steps) in zip(times, requests)), "every request got all its outputs"
    first = [t[0] - s for t, s in zip(times, submitted)]
    per_step = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    outputs = sum(len(t) for t in times)
    makespan = max(t[-1] for t in times) - min(submitted)
    return {"outputs_per_s": outputs / makespan, "ttft_p50": np.percentile(first, 50),
            "ttft_p99": np.percentile(first, 99), "step_p50": np.percentile(per_step, 50),
            "step_p99": np.percentile(per_step, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=200.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    module = gpt2()
    requests = workload(args.requests, args.rate, module.CONFIG["vocab_size"], module.CONTEXT)
    results = {}

    for label, slots in (("generation", args.slots), ("one at a time", 1)):
        generation = js.Generation(module.prefill, module.decode, params=module.load(), slots=slots,
                                   max_length=module.MAX_LENGTH, prefill_lengths=[16, module.CONTEXT], logits=True)
        with js.serve(generation, name="bench-generation") as server:
            def call(prompt, steps, record):
                for _ in js.generate_stream("bench-generation", prompt, max_steps=steps):
                    record(time.perf_counter())

            results[label] = drive(call, requests)
            results[label]["compiles"] = server.stats()["compiles"]

    with js.serve(streaming_serving(module, args.slots), name="bench-streaming"):
        def call_streaming(prompt, steps, record):
            tokens = np.zeros((1, module.CONTEXT), np.int32)
            tokens[0, :prompt.size] = prompt
            entry = {"tokens": tokens, "length": np.array([prompt.size], np.int32), "steps": np.array([steps])}
            stream = js.batched_stream("bench-streaming", js.Batch.concatenate([entry]))
            for _ in range(steps):
                next(stream)
                record(time.perf_counter())
            stream.close()

        results["streaming"] = drive(call_streaming, requests)

    print(f"GPT-2 example ({module.SIZE} config), {args.requests} requests, outputs 1..256, Poisson "
          f"{args.rate:g}/s, {args.slots} slots / batch size, XLA on {jax.devices()[0].device_kind}:")
    print("| server | outputs/s | first output p50 | p99 | per step p50 | p99 |")
    print("|---|---|---|---|---|---|")
    for label in ("generation", "streaming", "one at a time"):
        r = results[label]
        print(f"| {label} | {r['outputs_per_s']:,.0f} | {r['ttft_p50'] * 1e3:.1f} ms | {r['ttft_p99'] * 1e3:.1f} ms | "
              f"{r['step_p50'] * 1e3:.2f} ms | {r['step_p99'] * 1e3:.2f} ms |")
    ours, theirs = results["generation"], results["streaming"]
    print(f"generation / streaming: {ours['outputs_per_s'] / theirs['outputs_per_s']:.2f}x outputs/s (goal >= 3x); "
          f"p99 first output {ours['ttft_p99'] * 1e3:.1f} ms vs streaming's p50 {theirs['ttft_p50'] * 1e3:.1f} ms "
          f"(goal: below); over one at a time {ours['outputs_per_s'] / results['one at a time']['outputs_per_s']:.2f}x")


if __name__ == "__main__":
    main()
