"""The BERT and GPT-2 examples: agreement with ``transformers`` and served throughput against ``jax.jit``.

For each model (``examples/bert.py``, ``examples/gpt2.py``) at ``--size`` (``small``, the CI config, or
``full``: BERT-base and GPT-2's own 124 M parameters), this loads the example's weights (made from a
fixed seed on first use) into Hugging Face's PyTorch model, compares the logits of a batch, then times
the serving (``js.serve`` + ``js.batched_run`` with XLA, weights resident on the device) against
``jax.jit`` of the same function called directly with the same resident weights, at each of
``--batches`` rows per call. On a GPU machine, the device memory JAX holds is printed too.

    python3 dev.py bench models [--size full] [--batches 1 64] [--seconds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import jax
import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import jitserve as js
from jitserve.params import flatten

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(model, params):
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in flatten(params).items()}, strict=False)
    return model.eval()


def bert_case(size: str):
    module = example("bert")
    config = BertConfig(**module.CONFIG, num_labels=len(module.LABELS), hidden_act="gelu", hidden_dropout_prob=0,
                        attention_probs_dropout_prob=0, layer_norm_eps=module.LAYER_NORM_EPS)
    torch_model = reference(BertForSequenceClassification(config), module.serving.params)
    texts = [f"text number {i}: " + "lorem ipsum " * (i % 5) for i in range(8)]
    tokens = module.tokenize(texts)
    with torch.no_grad():
        expected = torch_model(**{k: torch.from_numpy(v).long() for k, v in tokens.items()}).logits.numpy()
    serving = module.serving.replace(preprocess=None, postprocess=None)
    return serving, (lambda rows: {k: np.resize(v, (rows, v.shape[1])) for k, v in tokens.items()}), \
        (lambda outputs: outputs), tokens, expected


def gpt2_case(size: str):
    module = example("gpt2")
    c = module.CONFIG
    config = GPT2Config(vocab_size=c["vocab_size"], n_positions=c["n_positions"], n_embd=c["n_embd"],
                        n_layer=c["n_layer"], n_head=c["n_head"], activation_function="gelu_new",
                        layer_norm_epsilon=module.LAYER_NORM_EPS, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch_model = reference(GPT2LMHeadModel(config), module.serving.params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, c["vocab_size"], (8, module.CONTEXT)).astype(np.int32)
    entry = {"tokens": tokens, "length": np.full(8, module.CONTEXT, np.int32)}
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(tokens).long()).logits[:, -1].numpy()
    return module.serving, (lambda rows: {k: np.resize(v, (rows, *v.shape[1:])) for k, v in entry.items()}), \
        (lambda outputs: outputs["logits"]), entry, expected


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
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    os.environ["JITSERVE_BERT"] = os.environ["JITSERVE_GPT2"] = args.size
    device = jax.devices()[0]
    print(f"{args.size} configs, XLA on {device.device_kind} ({device.platform}); rows/s, served and jax.jit direct")
    print("| model | max abs logit diff vs transformers | argmax equal | rows | served rows/s | jax.jit rows/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, case in (("bert", bert_case), ("gpt2", gpt2_case)):
        serving, rows_of, logits_of, sample, expected = case(args.size)
        largest = max(args.batches)
        serving = serving.replace(batch_size=largest, batch_sizes=sorted(set(args.batches)))
        jitted = jax.jit(serving.fn)
        resident = jax.device_put(serving.params, device)
        with js.serve(serving, name=name):
            got = logits_of(js.batched_run(name, js.Batch.concatenate([sample])))
            diff = float(np.abs(got - expected).max())
            same = bool((got.argmax(-1) == expected.argmax(-1)).all())
            for rows in args.batches:
                batch = rows_of(rows)
                served = rate(lambda: js.batched_run(name, js.Batch.concatenate([batch])), args.seconds) * rows
                direct = rate(lambda: jax.tree_util.tree_map(np.asarray, jitted(resident, batch)), args.seconds) * rows
                print(f"| {name} | {diff:.2e} | {same} | {rows} | {served:,.1f} | {direct:,.1f} | "
                      f"{served / direct:.2f} |")
    if device.platform == "gpu":
        stats = device.memory_stats() or {}
        print(f"device memory in use: {stats.get('bytes_in_use', 0) / 2**20:,.0f} MiB "
              f"(peak {stats.get('peak_bytes_in_use', 0) / 2**20:,.0f} MiB)")


if __name__ == "__main__":
    main()
