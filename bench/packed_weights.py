"""The host's time per call with many weight arrays: passed packed into few (jitserve.packed) or as given.

Each array a compiled call passes costs the host time, whatever its size; on a GPU a small model's
step is paced by the host, not the device (bench/README.md, "Generation"). Two callers of compiled code, each
with a model that does next to nothing, so that the host's work shows, and ``--weights`` weight
vectors of 4 elements (GPT-2 has 98 vectors among its 148 weights):

- the generation loop: host time per decode step (each adds one to every slot's token), 8 slots kept
  busy by 8 callers streaming ``--steps`` outputs each;
- a serving: time per 1-row ``js.batched_run`` from one caller, ``--calls`` calls.

Each with the weights packed, as js.Generation and js.Serving pass them, against the weights passed as
given (``jitserve.packed.PACKED_ELEMENTS = 0`` packs nothing). They take turns, ``--rounds`` times (this
machine's speed moves between runs); medians, and the ratio.

    python3 dev.py bench packed_weights [--weights 148] [--steps 2000] [--calls 3000] [--rounds 3]
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


def weights(count: int, packed: bool) -> dict[str, np.ndarray]:
    jitserve.packed.PACKED_ELEMENTS = 1 << 16 if packed else 0  # read when a server lays its weights out
    return {f"w{i}": np.zeros(4, np.float32) for i in range(count)}


def generation_step_us(args: argparse.Namespace, packed: bool) -> float:
    generation = js.Generation(prefill, decode, params=weights(args.weights, packed), slots=8,
                               max_length=args.steps + 8, prefill_lengths=[8])
    with js.serve(generation, name="bench-packed-generation") as server:
        js.generate("bench-packed-generation", [1, 2], max_steps=3)
        callers = [threading.Thread(target=js.generate, args=("bench-packed-generation", [1, 2]),
                                    kwargs={"max_steps": args.steps}) for _ in range(8)]
        before = server.stats().steps
        started = time.perf_counter()
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        return (time.perf_counter() - started) / (server.stats().steps - before) * 1e6


def serving_call_us(args: argparse.Namespace, packed: bool) -> float:
    serving = js.Serving(lambda params, x: x + params["w0"][0], params=weights(args.weights, packed),
                         batch_size=1, input_template=js.template(4, "float32"))
    row = js.Batch.stack([np.ones(4, np.float32)])
    with js.serve(serving, name="bench-packed-serving"):
        for _ in range(args.calls // 10):
            js.batched_run("bench-packed-serving", row)
        started = time.perf_counter()
        for _ in range(args.calls):
            js.batched_run("bench-packed-serving", row)
        return (time.perf_counter() - started) / args.calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=148)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for what, measure in (("generation loop, us per decode step", generation_step_us),
                          ("serving, us per 1-row call", serving_call_us)):
        rounds = [(measure(args, False), measure(args, True)) for _ in range(args.rounds)]
        given, packed = np.median(rounds, axis=0)
        print(f"{what}, {args.weights} weight vectors, median of {args.rounds} rounds: {given:.0f} as given, "
              f"{packed:.0f} packed ({given / packed:.2f}x; rounds: "
              f"{', '.join(f'{g:.0f}/{p:.0f}' for g, p in rounds)})", flush=True)


if __name__ == "__main__":
    main()
