"""Continuous batching (js.Generation) against request-level batching and one request at a time.

The model is ``examples/gpt2.py``'s checkpoint (the small config unless ``JITSERVE_GPT2=full``), its
``prefill`` and ``decode`` as ``js.from_pretrained`` gives them, over token ids (no tokenizer, no end
token, so that each request runs its length): greedy decoding with its KV cache. 64 requests (``--requests``), each with a random prompt of 1..32 tokens and an
output length drawn uniformly from 1..256 (fixed seed), arrive in a Poisson stream. Three servers, the
same slots / batch size (``--slots``), all warm before the clock starts:

- ``generation``: ``js.Generation(prefill, decode, slots=...)``, admitting requests between steps;
- ``generation, N steps per launch``: the same with ``steps_per_launch=N`` (``--steps-per-launch``, 4;
  1 leaves this arm out), admitting requests between launches of N steps;
- ``streaming``: today's ``js.Serving(..., streaming=True)`` whose generator prefills a batch and
  decodes it until its longest request is done (each request reads its own outputs, then leaves), the
  same jitted prefill and decode inside; a batch holds its rows to its end;
- ``one at a time``: ``js.Generation`` with one slot.

Two loads: a flood (``--rate`` per second, all 64 queued within a third of a second), then a busy
server (``--load`` of the generation server's capacity, measured in the flood: its outputs/s over the
mean outputs per request). The arms take turns, ``--rounds`` times per load (this machine's speed moves
between runs), and each figure is the median over rounds: outputs per second (all outputs over the time
from the first arrival to the last output), p50 / p99 time to first output, p50 / p99 time per output
step (a request's time from its first to its last output over its outputs after the first), and the
decode steps each server ran. Last, the floor of a step: the decode step alone, queued back to back
with no host work between steps, at ``--slots`` and at one slot, and how much of it the host spends
inside the call that queues a step (on a GPU, launching it), with the weights as the example's tree
of arrays and packed into fewer arrays as js.Generation passes them (``jitserve.packed``), and with N
steps per launch. Goals:
generation >= 3x the outputs/s of streaming, and its p99 time to first output below streaming's p50.
At equal cost per step, streaming's decode steps over generation's bound the first ratio:
request-level batching keeps a row busy until its batch's longest request ends.

    python3 dev.py bench generation [--requests 64] [--rate 200] [--load 0.8] [--rounds 3] [--slots 8]
                                    [--steps-per-launch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js
from jitserve.packed import PackedLayout
from jitserve.template import templates_of

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONTEXT = 32  # the longest prompt, and the longest prefill length


def gpt2() -> js.Generation:
    """``examples/gpt2.py``'s checkpoint with the slot cache (its ``prefill`` and ``decode``, which the
    request-level arm calls too; ``bench/paged.py`` measures the paged cache against it)."""
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("example_gpt2", EXAMPLES / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return js.from_pretrained(module.gpt2(), kv_cache="slots", slots=8)


def workload(requests: int, rate: float, vocab: int, context: int, seed: int = 0):
    """(arrival offset in seconds, prompt, output length) per request."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, requests))
    return [(float(at), rng.integers(1, vocab, int(rng.integers(1, context + 1))).astype(np.int32),
             int(rng.integers(1, 257))) for at in arrivals]


def greedy_programs(model: js.Generation, layout: PackedLayout | None = None, per_launch: int = 1):
    """The model's prefill (over a batch of prompts) and decode, jitted, each picking the most likely token
    (the model's functions give logits), decode's state donated; with a ``layout``, they take the weights
    packed as it lays them out (as js.Generation's programs do), else as the example's tree of arrays; decode
    runs ``per_launch`` steps per call, unrolled (as js.Generation(..., steps_per_launch=...) does)."""
    def greedy(step, steps=1):
        def picked(params, state, *arguments):
            params = params if layout is None else layout.unpack(params)
            for _ in range(steps):
                state, logits = step(params, state, *arguments)
                arguments = (jnp.argmax(logits, axis=-1).astype(jnp.int32),)
            return state, *arguments
        return picked

    return (jax.jit(greedy(jax.vmap(model.prefill, in_axes=(None, 0, 0)))),
            jax.jit(greedy(model.decode, per_launch), donate_argnums=1))


def device_step_ms(model: js.Generation, params, slots: int, packed: bool, per_launch: int = 1,
                   steps: int = 200) -> tuple[float, float, int]:
    """The floor of a decode step: ``steps`` greedy steps of ``slots`` prompts queued back to back with no
    host work between them, ``per_launch`` per call, ms per step, and the part of it the host spent inside
    the calls that queue them (launching the steps: where that is most of a step, the host, not the
    device, sets the pace); medians of 3 runs, ``params`` on the device, passed as the example's tree or
    ``packed`` (then fewer arrays per call); and the number of weight arrays each call passed."""
    layout = PackedLayout(templates_of(params)) if packed else None
    if layout is not None:
        params = jax.device_put(layout.pack(params))
    many_prefill, decode = greedy_programs(model, layout, per_launch)
    tokens = np.ones((slots, CONTEXT), np.int32)
    state, last = many_prefill(params, tokens, np.full(slots, 4, np.int32))
    times, launches = [], []
    for _ in range(4):  # the first compiles
        launching = 0.0
        started = time.perf_counter()
        for _ in range(steps // per_launch):
            called = time.perf_counter()
            state, last = decode(params, state, last)
            launching += time.perf_counter() - called
        last.block_until_ready()
        times.append((time.perf_counter() - started) / steps * 1e3)
        launches.append(launching / steps * 1e3)
    return float(np.median(times[1:])), float(np.median(launches[1:])), len(jax.tree_util.tree_leaves(params))


def streaming_serving(model: js.Generation, params, slots: int, steps: list[int]) -> js.Serving:
    """Request-level batching: a generator over one batch of prompts, decoding until its longest is done
    (its decode steps counted in ``steps[0]``); ``params`` on the device."""
    many_prefill, decode = greedy_programs(model)

    def generate(entry):
        state, tokens = many_prefill(params, jnp.asarray(entry["tokens"]), jnp.asarray(entry["length"]))
        yield np.asarray(tokens)
        for _ in range(int(np.max(entry["steps"])) - 1):
            state, tokens = decode(params, state, tokens)
            steps[0] += 1
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


def measure(arms: dict, requests, rounds: int) -> dict:
    """Each arm's figures per round, the arms taking turns; ``arms``: label -> (call, decode steps so far)."""
    figures: dict[str, list[dict]] = {label: [] for label in arms}
    for _ in range(rounds):
        for label, (call, steps) in arms.items():
            before = steps()
            figures[label].append({**drive(call, requests), "steps": steps() - before})
    return figures


def report(title: str, figures: dict) -> None:
    def median(label, key):
        return float(np.median([round_[key] for round_ in figures[label]]))

    print(title, flush=True)
    print("| server | outputs/s | first output p50 | p99 | per step p50 | p99 | decode steps |")
    print("|---|---|---|---|---|---|---|")
    for label in figures:
        print(f"| {label} | {median(label, 'outputs_per_s'):,.0f} | {median(label, 'ttft_p50') * 1e3:.1f} ms | "
              f"{median(label, 'ttft_p99') * 1e3:.1f} ms | {median(label, 'step_p50') * 1e3:.2f} ms | "
              f"{median(label, 'step_p99') * 1e3:.2f} ms | {median(label, 'steps'):,.0f} |")
    for label in [label for label in figures if label.startswith("generation, ")]:
        ratios = [ours["outputs_per_s"] / theirs["outputs_per_s"]
                  for ours, theirs in zip(figures[label], figures["streaming"])]
        print(f"{label} / streaming: {np.median(ratios):.2f}x outputs/s (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    ratios = [ours["outputs_per_s"] / theirs["outputs_per_s"]
              for ours, theirs in zip(figures["generation"], figures["streaming"])]
    print(f"generation / streaming: {np.median(ratios):.2f}x outputs/s (goal >= 3x; rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); at equal cost per step at most "
          f"{median('streaming', 'steps') / median('generation', 'steps'):.2f}x (streaming's decode steps over "
          f"generation's); p99 first output {median('generation', 'ttft_p99') * 1e3:.1f} ms vs streaming's p50 "
          f"{median('streaming', 'ttft_p50') * 1e3:.1f} ms (goal: below); over one at a time "
          f"{median('generation', 'outputs_per_s') / median('one at a time', 'outputs_per_s'):.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=200.0, help="the flood's mean arrivals per second (Poisson)")
    parser.add_argument("--load", type=float, default=0.8, help="the busy load, a fraction of generation's capacity")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps-per-launch", type=int, default=4,
                        help="an arm of js.Generation(..., steps_per_launch=N) beside the default one (1: none)")
    args = parser.parse_args()
    model = gpt2()
    vocab = model.params["transformer"]["wte"]["weight"].shape[0]
    streaming_steps = [0]

    def generation_arm(name: str, slots: int, stack: contextlib.ExitStack, steps_per_launch: int = 1):
        generation = js.Generation(model.prefill, model.decode, params=model.params, slots=slots,
                                   max_length=model.max_length, prefill_lengths=[16, CONTEXT], logits=True,
                                   steps_per_launch=steps_per_launch)
        server = stack.enter_context(js.serve(generation, name=name))

        def call(prompt, steps, record):
            for _ in js.generate_stream(name, prompt, max_steps=steps):
                record(time.perf_counter())

        return call, lambda: server.stats().steps

    def call_streaming(prompt, steps, record):
        tokens = np.zeros((1, CONTEXT), np.int32)
        tokens[0, :prompt.size] = prompt
        entry = {"tokens": tokens, "length": np.array([prompt.size], np.int32), "steps": np.array([steps])}
        stream = js.batched_stream("bench-streaming", js.Batch.concatenate([entry]))
        for _ in range(steps):
            next(stream)
            record(time.perf_counter())
        stream.close()

    with contextlib.ExitStack() as stack:
        resident = jax.device_put(model.params)
        stack.enter_context(js.serve(streaming_serving(model, resident, args.slots, streaming_steps),
                                     name="bench-streaming"))
        call_streaming(np.ones(4, np.int32), 2, lambda _: None)  # compiles its prefill and decode
        launches = args.steps_per_launch
        arms = {"generation": generation_arm("bench-generation", args.slots, stack),
                **({f"generation, {launches} steps per launch": generation_arm(
                    "bench-launches", args.slots, stack, launches)} if launches > 1 else {}),
                "streaming": (call_streaming, lambda: streaming_steps[0]),
                "one at a time": generation_arm("bench-one", 1, stack)}
        size = os.environ.get("JITSERVE_GPT2", "small")
        setting = (f"GPT-2 example ({size} config), {args.requests} requests, outputs 1..256, {args.slots} "
                   f"slots / batch size, XLA on {jax.devices()[0].device_kind}, median of {args.rounds} rounds")
        requests = workload(args.requests, args.rate, vocab, CONTEXT)
        flood = measure(arms, requests, args.rounds)
        report(f"{setting}; flood: Poisson {args.rate:g}/s", flood)
        outputs_per_request = np.mean([steps for _, _, steps in requests])
        capacity = np.median([r["outputs_per_s"] for r in flood["generation"]]) / outputs_per_request
        busy_rate = args.load * capacity
        busy = measure(arms, workload(args.requests, busy_rate, vocab, CONTEXT),
                       args.rounds)
        report(f"{setting}; busy: Poisson {busy_rate:.1f}/s ({args.load:g} of generation's capacity, "
               f"{capacity:.1f} requests/s)", busy)
        floors = [(slots, packed, per_launch, *device_step_ms(model, resident, slots, packed, per_launch))
                  for slots, packed, per_launch in [(args.slots, False, 1), (args.slots, True, 1),
                                                    *([(args.slots, True, launches)] if launches > 1 else []),
                                                    (1, True, 1)]]
        print("decode step alone, queued back to back (the floor of a step; the host's time inside the call "
              "that queues it, per step): " + ", ".join(
                  f"{step:.2f} ms ({launch:.2f} ms) at {slots} slot{'s' if slots > 1 else ''} with the weights "
                  f"{'packed' if packed else 'as given'}, {arrays} arrays"
                  f"{f', {per_launch} steps per launch' if per_launch > 1 else ''}"
                  for slots, packed, per_launch, step, launch, arrays in floors),
              flush=True)


if __name__ == "__main__":
    main()
