"""The paged KV cache against the slot cache, in one run, on a Llama-shaped checkpoint made as the tests make
theirs (``bench/pretrained.py``'s maker; ``--size small`` or ``medium``, ~30 M parameters):

(a) at equal KV memory (``--slots`` x ``--max-length`` positions: the slot cache's rows, the paged cache's
    pool, which runs up to 8x the sequences), ``--requests`` requests of mixed prompt (1..64 words) and output
    (1..128 tokens) lengths, all at once: the most sequences running at once, outputs/s, and the ratios;
(b) 16 requests sharing a ~180-token prefix, one after another: time to first output, p50, with and without
    prefix caching;
(c) the paged decode step against its floor: the bytes it must read (the weights, and the keys and values of
    the positions it attends over) at the memory bandwidth a numpy copy reaches here;
(d) the same for one sequence alone on a generation of 32 slots, whose launches run the rows it needs.

``bench/pretrained.py`` measures tokens/s against ``transformers``' batched ``generate`` (d).

    python3 dev.py bench paged [--size medium] [--requests 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import jitserve as js

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import checkpoints
from pretrained import SIZES, make

WORDS = " ".join(checkpoints.CORPUS).split()
PREFIX = " ".join(checkpoints.CORPUS[:4])
LONE_STEPS = 64


def workload(requests: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, output length) per request: prompts of 1..64 words, outputs of 1..128 tokens."""
    rng = np.random.default_rng(seed)
    return [(" ".join(WORDS[start:start + words]), int(steps)) for start, words, steps in
            zip(rng.integers(0, 40, requests), rng.integers(1, 65, requests), rng.integers(1, 129, requests))]


def flood(name: str, server, requests: list[tuple[str, int]]) -> tuple[float, int, int]:
    """Every request at once: seconds, outputs, the most sequences running at once."""
    before = server.stats().outputs
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(lambda r: js.generate(name, r[0], max_steps=r[1]), requests))
    elapsed = time.perf_counter() - started
    stats = server.stats()
    return elapsed, stats.outputs - before, stats.max_slots_busy


def first_output_p50(name: str, prompts: list[str]) -> float:
    times = []
    for prompt in prompts:
        started = time.perf_counter()
        stream = js.generate_stream(name, prompt, max_steps=2)
        next(iter(stream))
        times.append(time.perf_counter() - started)
        stream.close()
    return statistics.median(times)


def bandwidth() -> float:
    """Bytes per second a numpy copy of 256 MB reads and writes here (the best of 5)."""
    source = np.ones(2**28, np.uint8)
    target = np.empty_like(source)
    best = min(_timed(lambda: np.copyto(target, source)) for _ in range(5))
    return 2 * source.nbytes / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def lone_step(llama: Path, common: dict) -> tuple[float, int]:
    """The decode step of one sequence alone on a generation of 32 slots (a launch of the rows it needs, issue
    57), over ``LONE_STEPS`` steps of a 20-word prompt; and those steps."""
    generation = js.from_pretrained(llama, slots=32, **common)
    with js.serve(generation, name="lone") as server:
        js.generate("lone", "warm", max_steps=2)
        before = server.stats()
        js.generate("lone", " ".join(WORDS[:20]), max_steps=LONE_STEPS, ignore_eos=True)
        after = server.stats()
    return (after.step_s - before.step_s) / (after.steps - before.steps), LONE_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        llama, _ = make(Path(folder), args.size)
        config = json.loads((llama / "config.json").read_text())  # rotary positions: any context the bench asks
        (llama / "config.json").write_text(json.dumps({**config, "max_position_embeddings": args.max_length}))
        memory = args.slots * args.max_length
        common = {"max_length": args.max_length, "prefill_lengths": [16, 64]}  # the paged cache's chunks
        slot = js.from_pretrained(llama, kv_cache="slots", slots=args.slots, max_length=args.max_length,
                                  prefill_lengths=[16, 64, args.max_length])  # a prompt is prefilled whole
        paged = js.from_pretrained(llama, slots=8 * args.slots, kv_cache_tokens=memory, **common)
        requests = workload(args.requests)
        results = {}
        for name, generation in (("slots", slot), ("paged", paged)):
            with js.serve(generation, name=name) as server:
                js.generate(name, "warm", max_steps=2)
                results[name] = (*flood(name, server, requests), server.stats())
        (slot_s, slot_out, slot_busy, _), (paged_s, paged_out, paged_busy, paged_stats) = results.values()
        rows.append(["(a) sequences at once", f"{slot_busy}", f"{paged_busy}", f"{paged_busy / slot_busy:.2f}x"])
        rows.append(["(a) outputs/s", f"{slot_out / slot_s:,.0f}", f"{paged_out / paged_s:,.0f}",
                     f"{(paged_out / paged_s) / (slot_out / slot_s):.2f}x"])
        prompts = [PREFIX + f" Question {i}:" for i in range(16)]
        p50 = {}
        for caching in (False, True):
            generation = js.from_pretrained(llama, slots=16, prefix_caching=caching, **common)
            with js.serve(generation, name=f"prefix-{caching}") as server:
                js.generate(f"prefix-{caching}", PREFIX, max_steps=2)
                p50[caching] = first_output_p50(f"prefix-{caching}", prompts)
                hits = server.stats().prefix_hits
        rows.append(["(b) first output p50, shared prefix", f"{p50[False] * 1e3:.1f} ms (no prefix cache)",
                     f"{p50[True] * 1e3:.1f} ms ({hits} blocks reused)", f"{p50[False] / p50[True]:.2f}x lower"])
        slot_stats = results["slots"][3]
        rows.append(["(a) decode step", f"{slot_stats.step_s / max(slot_stats.steps, 1) * 1e6:,.0f} us",
                     f"{paged_stats.step_s / max(paged_stats.steps, 1) * 1e6:,.0f} us", ""])
        step = paged_stats.step_s / max(paged_stats.steps, 1)
        weights = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(paged.params))
        cache = paged.cache
        position = 2 * cache.layers * cache.kv_heads * cache.head_dim * cache.dtype.itemsize
        attended = paged_out / max(paged_stats.steps, 1) * np.mean([len(p.split()) * 1.5 + s / 2 for p, s in requests])
        floor = (weights + attended * position) / bandwidth()
        rows.append(["(c) paged decode step vs floor", f"floor {floor * 1e6:,.0f} us", f"{step * 1e6:,.0f} us",
                     f"{step / floor:.1f}x the floor"])
        alone, steps = lone_step(llama, common)
        floor = (weights + steps * position / 2) / bandwidth()  # the weights, and half its positions on average
        rows.append(["(d) one sequence alone at 32 slots: decode step vs floor", f"floor {floor * 1e6:,.0f} us",
                     f"{alone * 1e6:,.0f} us", f"{alone / floor:.1f}x the floor"])
    device = jax.devices()[0]
    print(f"# {args.size} Llama-shaped checkpoint on {device.platform} ({device.device_kind}); equal KV memory: "
          f"{memory:,} positions ({args.slots} slots x {args.max_length}); {args.requests} requests")
    header = ["measure", "slot cache / baseline", "paged cache", "ratio"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
