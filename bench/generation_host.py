"""The generation loop's own cost per step: a decode that does next to nothing, so the host's work shows.

On a GPU a decode step of a small model is paced by the host, not the device (README, "Generation"):
the call that launches it and the loop's Python between launches. This measures both with a trivial
model (each step adds one to every slot's token) whose weights are ``--weights`` vectors of 4
elements (GPT-2 has 98 vectors among its 148 weights), 8 slots kept busy by 8 callers: host time per
decode step with the weights packed into one array, as js.Generation passes them, against the weights
passed as given (``jitserve.packed.PACKED_ELEMENTS = 0`` packs nothing). The two take turns,
``--rounds`` times (this machine's speed moves between runs); medians.

    python3 dev.py bench generation_host [--weights 148] [--steps 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import threading
import time

import jax.numpy as jnp
import numpy as np

import jitserve as js
import jitserve.packed

VOCAB = 64


def prefill(params, tokens, length):
    return {"token": tokens[length - 1]}, (tokens[length - 1] + 1) % VOCAB


def decode(params, state, last):
    return {"token": last}, (last + params["w0"][0].astype(jnp.int32) + 1) % VOCAB


def microseconds_per_step(weights: int, steps: int, packed: bool) -> float:
    jitserve.packed.PACKED_ELEMENTS = 1 << 16 if packed else 0
    params = {f"w{i}": np.zeros(4, np.float32) for i in range(weights)}
    generation = js.Generation(prefill, decode, params=params, slots=8, max_length=steps + 8, prefill_lengths=[8])
    with js.serve(generation, name="bench-host") as server:
        js.generate("bench-host", [1, 2], max_steps=3)
        callers = [threading.Thread(target=js.generate, args=("bench-host", [1, 2]), kwargs={"max_steps": steps})
                   for _ in range(8)]
        before = server.stats()["steps"]
        started = time.perf_counter()
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        return (time.perf_counter() - started) / (server.stats()["steps"] - before) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=148)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [(microseconds_per_step(args.weights, args.steps, False),
               microseconds_per_step(args.weights, args.steps, True)) for _ in range(args.rounds)]
    given, packed = np.median(rounds, axis=0)
    print(f"generation loop, trivial decode, 8 slots, {args.weights} weight vectors, median of {args.rounds} "
          f"rounds: {given:.0f} us per step with the weights as given, {packed:.0f} us packed "
          f"({given / packed:.2f}x; rounds: {', '.join(f'{g:.0f}/{p:.0f}' for g, p in rounds)})", flush=True)


if __name__ == "__main__":
    main()
