"""What per-request controls cost: outputs/s of a checkpoint's generation for requests that ask for none of them
(greedy, and sampled), for requests that ask for log-probabilities, and for requests that ask for penalties,
in the paged cache and the slot cache, in one run.

The checkpoint is ``bench/pretrained.py``'s Llama (``--size small``, the test config, or ``medium``). Each arm
sends ``--requests`` concurrent requests of ``--tokens`` outputs each to a warm server of ``--slots`` slots;
the arms take turns ``--rounds`` times (this machine's speed moves between runs) and each figure is the
median over rounds:

- ``greedy``: no options (the greedy programs: an argmax per row);
- ``sampled``: temperature 0.8, top_p 0.95, a seed each (the sampling programs: a sort per row);
- ``logprobs``: sampled, with ``logprobs=5`` (the scored programs: the penalties' rules at neutral values,
  a log-softmax and the 20 most likely tokens per row, and the host's ``TokenLogprobs``);
- ``penalties``: sampled, with repetition 1.2, presence 0.5 and frequency 0.5 (the scored programs, and the
  penalties' counts started per request).

A request that asks for none of them runs the programs it ran before log-probabilities and penalties
existed: to compare with an older jitserve, run this script with its ``src`` on ``PYTHONPATH`` and
``--arms greedy sampled`` (the arms it knows).

    python3 dev.py bench controls [--size medium] [--requests 16] [--tokens 64] [--rounds 5] [--arms ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

import jitserve as js

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrained import PROMPT, SIZES, make

SAMPLED = {"temperature": 0.8, "top_p": 0.95}
ARMS = {"greedy": {}, "sampled": SAMPLED, "logprobs": {**SAMPLED, "logprobs": 5},
        "penalties": {**SAMPLED, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5}}
ENGINES = {"paged": {}, "slots": {"kv_cache": "slots"}}


def outputs_per_second(name: str, options: dict, requests: int, tokens: int) -> float:
    """Every request at once, each seeded apart: all their outputs over the time they took."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        list(pool.map(lambda i: js.generate(name, PROMPT, max_steps=tokens, seed=i, **options)
                      if options else js.generate(name, PROMPT, max_steps=tokens), range(requests)))
    return requests * tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        llama, _ = make(Path(folder), args.size)
        for engine, options in ENGINES.items():
            generation = js.from_pretrained(llama, slots=args.slots, max_length=256, prefill_lengths=[16, 64],
                                            **options)
            with js.serve(generation, name=engine) as server:
                for arm in args.arms:  # every program once before the clock starts
                    outputs_per_second(engine, ARMS[arm], 2, 2)
                rates: dict[str, list[float]] = {arm: [] for arm in args.arms}
                for _ in range(args.rounds):
                    for arm in args.arms:
                        rates[arm].append(outputs_per_second(engine, ARMS[arm], args.requests, args.tokens))
                compiles = server.stats().compiles
            medians = {arm: statistics.median(values) for arm, values in rates.items()}
            base = medians.get("sampled")
            for arm, rate in medians.items():
                spread = f"{min(rates[arm]):,.0f}-{max(rates[arm]):,.0f}"
                rows.append([engine, arm, f"{rate:,.0f}", spread, f"{rate / base:.2f}x" if base else "-",
                             str(compiles)])
    device = jax.devices()[0]
    print(f"# {args.size} Llama on {device.platform} ({device.device_kind}); {args.requests} requests of "
          f"{args.tokens} outputs at once, {args.slots} slots; medians of {args.rounds} rounds")
    header = ["cache", "arm", "outputs/s", "range", "vs sampled", "programs compiled"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
