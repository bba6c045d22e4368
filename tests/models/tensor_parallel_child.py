"""Run by test_tensor_parallel.py in a process of its own, whose XLA host platform has several devices (the
flag is read when jax starts): serves each checkpoint on one device and split over N, and prints what the
test compares as one JSON line: the texts, the shapes of each device's share of a query projection and of
the KV cache, and the refusals that need several devices to reach."""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import jax

import jitserve as js
from jitserve.params import flatten

QUERY = ("self_attn.q_proj.weight", "attn.c_attn.weight")  # Llama's query projection, GPT-2's fused one


def shares(arrays: list[jax.Array], devices: int, rank: int | None = None, shape: tuple[int, ...] | None = None):
    """Each device's share (shard shapes, one per device) of each array split over ``devices`` devices."""
    return sorted({json.dumps([list(s.data.shape) for s in a.addressable_shards]) for a in arrays
                   if len(a.sharding.device_set) == devices and len({s.device for s in a.addressable_shards})
                   == devices and (rank is None or a.ndim == rank) and (shape is None or a.shape == shape)})


def served(folder: str, devices: int, prompts: list[str], steps: int) -> dict:
    generation = js.from_pretrained(folder, slots=2, max_length=96, prefill_lengths=[16, 64], devices=devices)
    query = next(tuple(array.shape) for key, array in flatten(generation.params).items() if key.endswith(QUERY))
    name = f"{Path(folder).name}-on-{devices}"
    before = {id(a) for a in jax.live_arrays()}
    with js.serve(generation, name=name) as server:
        alone = [js.generate(name, prompt, max_steps=steps) for prompt in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda prompt: js.generate(name, prompt, max_steps=steps), prompts * 2))
        sampled = js.generate(name, prompts[1], max_steps=steps, temperature=0.8, top_k=20, seed=1)
        new = [a for a in jax.live_arrays() if id(a) not in before]  # the weights placed, the slots' state
        found = {"alone": alone, "together": together, "sampled": sampled, "query": list(query),
                 "query_shares": shares(new, devices, shape=query), "cache_shares": shares(new, devices, rank=5)}
        del new
        server.update_params(generation.params)  # placed again, split as before
        found["updated"] = js.generate(name, prompts[1], max_steps=steps)
    return found


def refusal(folder: str, devices: int) -> str:
    try:
        js.from_pretrained(folder, devices=devices)
    except js.OptionError as error:
        return str(error)
    return "not refused"


def main() -> None:
    plan = json.loads(sys.argv[1])  # {"folders": {variant: folder}, "devices": {variant: [N...]}, ...}
    results = {variant: {str(n): served(plan["folders"][variant], n, plan["prompts"], plan["steps"])
                         for n in [1, *counts]} for variant, counts in plan["devices"].items()}
    refusals = {f"{variant} on {n}": refusal(plan["folders"][variant], n) for variant, n in plan["refused"]}
    print(json.dumps({"devices": len(jax.devices()), "served": results, "refused": refusals}))


if __name__ == "__main__":
    main()
