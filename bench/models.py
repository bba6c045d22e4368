"""The examples' checkpoints: agreement with ``transformers`` and served throughput against ``jax.jit``.

For each example (``examples/bert.py``, ``examples/gpt2.py``, ``examples/llama.py``) at ``--size``
(``small``, the CI configs, or ``full``: BERT-base, GPT-2's own 124 M parameters and Llama 3.2 1B's shape
in bfloat16), this takes the checkpoint folder the example serves (made by ``examples/make_checkpoint.py``
on first use), loads it into Hugging Face's PyTorch model too (``AutoModelFor...from_pretrained``), compares
the logits of a batch, then times the serving (``js.serve`` + ``js.batched_run`` with XLA, weights resident
on the device) against ``jax.jit`` of the same function called directly with the same resident weights, at
each of ``--batches`` rows per call. BERT's serving is the example's, texts tokenized once up front (its
preprocess and postprocess left out); the decoders' is the next token's logits of prompts of ``CONTEXT``
tokens through the example generation's own ``prefill``. On a GPU machine, the device memory JAX holds is
printed too.

    python3 dev.py bench models [--size full] [--models bert gpt2] [--batches 1 64] [--seconds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import jitserve as js

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONTEXT = 32  # the decoders' prompt length


def example(name: str):
    """``examples/NAME.py``, its folder importable (for its sibling ``make_checkpoint``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bert_case():
    serving = example("bert").serving
    texts = [f"text number {i}: " + "what a great film " * (i % 5) for i in range(8)]
    batch = serving.preprocess(texts)
    tokens, key = batch.materialize(), batch.user_key
    torch_model = AutoModelForSequenceClassification.from_pretrained(sys.modules["make_checkpoint"].bert()).eval()
    with torch.no_grad():
        expected = torch_model(**{k: torch.from_numpy(v).long() for k, v in tokens.items()}).logits.float().numpy()
    serving = serving.replace(preprocess=None, postprocess=None)
    return serving, key, tokens, (lambda outputs: outputs["logits"]), expected


def decoder_case(name: str):
    example(name)
    generation = js.from_pretrained(getattr(sys.modules["make_checkpoint"], name)(), kv_cache="slots")
    many_prefill = jax.vmap(generation.prefill, in_axes=(None, 0, 0))

    def next_token(params, entry):
        """The logits of the token after each prompt (the cache rows prefill also makes are dropped)."""
        return many_prefill(params, entry["tokens"], entry["length"])[1]

    serving = js.Serving(next_token, params=generation.params, batch_size=8, batch_timeout=0.002,
                         input_template={"tokens": js.template((CONTEXT,), "int32"), "length": js.template((), "int32")})
    folder = getattr(sys.modules["make_checkpoint"], name)()
    torch_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, torch_model.config.vocab_size, (8, CONTEXT)).astype(np.int32)
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(tokens).long()).logits[:, -1].float().numpy()
    return serving, None, {"tokens": tokens, "length": np.full(8, CONTEXT, np.int32)}, (lambda outputs: outputs), \
        expected


def rate(call, seconds: float) -> float:
    call()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        calls += 1
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "full"], default="small")
    parser.add_argument("--models", choices=["bert", "gpt2", "llama"], nargs="+", default=["bert", "gpt2", "llama"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    os.environ["JITSERVE_BERT"] = os.environ["JITSERVE_GPT2"] = os.environ["JITSERVE_LLAMA"] = args.size
    device = jax.devices()[0]
    print(f"{args.size} configs, XLA on {device.device_kind} ({device.platform}); rows/s, served and jax.jit direct")
    print("| model | max abs logit diff vs transformers | argmax equal | rows | served rows/s | jax.jit rows/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        serving, key, sample, logits_of, expected = bert_case() if name == "bert" else decoder_case(name)
        largest = max(args.batches)
        serving = serving.replace(batch_size=largest, batch_sizes=sorted(set(args.batches)))
        jitted = jax.jit(serving.batch_function(key))
        resident = jax.device_put(serving.params, device)

        def rows_of(rows):
            return {k: np.resize(v, (rows, *v.shape[1:])) for k, v in sample.items()}

        with js.serve(serving, name=name):
            got = logits_of(js.batched_run(name, js.Batch.concatenate([sample]).key(key)))
            diff = float(np.abs(got - expected).max())
            same = bool((got.argmax(-1) == expected.argmax(-1)).all())
            for rows in args.batches:
                batch = rows_of(rows)
                served = rate(lambda: js.batched_run(name, js.Batch.concatenate([batch]).key(key)),
                              args.seconds) * rows
                direct = rate(lambda: jax.tree_util.tree_map(np.asarray, jitted(resident, batch)), args.seconds) * rows
                print(f"| {name} | {diff:.2e} | {same} | {rows} | {served:,.1f} | {direct:,.1f} | "
                      f"{served / direct:.2f} |", flush=True)
    if device.platform == "gpu":
        stats = device.memory_stats() or {}
        print(f"device memory in use: {stats.get('bytes_in_use', 0) / 2**20:,.0f} MiB "
              f"(peak {stats.get('peak_bytes_in_use', 0) / 2**20:,.0f} MiB)")


if __name__ == "__main__":
    main()
