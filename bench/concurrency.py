"""Generation at scale: tokens/s of a Llama-shaped checkpoint served by ``js.from_pretrained`` (the paged KV
cache) at 1, 8, 64 and 256 concurrent requests against ``transformers``' batched ``generate`` of as many
prompts on the same device, and the decode step against its floor (the bytes a step must read, the weights
and the keys and values of every running sequence, over the memory bandwidth a copy reaches there).

Each request has its own prompt (``PROMPT`` after a number, 14-16 tokens) and makes exactly ``--tokens``
outputs (``min_tokens``, as ``min_new_tokens`` for ``transformers``), greedy. jitserve: one server with
``max(--concurrency)`` slots and a pool of that many sequences' ``--max-length``, N threads each calling
``js.generate``, prefill included; ``transformers``: ``generate`` of the N prompts, left-padded, after a
warm-up of the same batch.

``--size``: ``small`` and ``medium`` (``bench/pretrained.py``'s, for a CPU) or ``1b``, Llama 3.2 1B's shape
(16 layers, 2,048 wide, an 8,192 MLP, 32 heads over 8 KV heads, tied embeddings) with a 32,000-token
vocabulary: 1.0 B parameters. The weights are random (``transformers``' own initialisation, nothing is
downloaded) and served in ``--dtype`` (``bfloat16`` by default); the tokenizer is the tests' (a byte-level
BPE of 320 tokens: ids above it print as nothing, which changes no count here).

    python3 dev.py bench concurrency --size 1b                # a GPU
    python3 dev.py bench concurrency --size small --concurrency 1 8 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import jitserve as js

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import checkpoints
from pretrained import PROMPT, SIZES, make

ONE_B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": True}


def checkpoint(folder: Path, size: str, dtype: str, max_length: int) -> Path:
    """The Llama-shaped checkpoint of ``size``, its weights stored in ``dtype``."""
    if size != "1b":
        llama, _ = make(folder, size)
    else:
        llama = checkpoints.llama(folder / "llama")
        config = AutoModelForCausalLM.from_pretrained(llama).config
        for key, value in ONE_B.items():
            setattr(config, key, value)
        AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(llama)
    config = json.loads((llama / "config.json").read_text())  # rotary positions: any context the bench asks
    (llama / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_length}))
    return llama


def prompts(n: int) -> list[str]:
    return [f"{i}. {PROMPT}" for i in range(n)]


def theirs(folder: Path, dtype: str, concurrency: list[int], tokens: int) -> dict[int, float]:
    """``transformers``' tokens/s per batch size, on the GPU when there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    rates = {}
    with torch.no_grad():
        for n in concurrency:
            ids = tokenizer(prompts(n), return_tensors="pt", padding=True).to(device)
            options = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False,
                       "pad_token_id": tokenizer.eos_token_id}
            model.generate(**ids, **options)
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model.generate(**ids, **options)
            if device == "cuda":
                torch.cuda.synchronize()
            rates[n] = n * tokens / (time.perf_counter() - started)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rates


def bandwidth() -> float:
    """Bytes per second a compiled copy of 1 GiB reads and writes on jax's default device (the best of 5)."""
    source = jnp.ones(2**30, jnp.uint8)
    copy = jax.jit(lambda x: x + 1)
    copy(source).block_until_ready()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        copy(source).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best


def ours(folder: Path, dtype: str, concurrency: list[int], tokens: int, max_length: int) -> list[list[str]]:
    slots = max(concurrency)
    started = time.perf_counter()
    generation = js.from_pretrained(folder, dtype=dtype, max_length=max_length, slots=slots,
                                    kv_cache_tokens=slots * max_length)
    rows = []
    with js.serve(generation, name="llm") as server:
        js.generate("llm", PROMPT, max_steps=2)
        start_up = time.perf_counter() - started
        weights = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(generation.params))
        cache = generation.cache
        position = 2 * cache.layers * cache.kv_heads * cache.head_dim * cache.dtype.itemsize
        rate = bandwidth()
        prompt = len(generation.preprocess.tokenizer.encode(prompts(1)[0]))
        for n in concurrency:
            before = server.stats()
            began = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p: js.generate("llm", p, max_steps=tokens, min_tokens=tokens), prompts(n)))
            elapsed = time.perf_counter() - began
            after = server.stats()
            steps = after.steps - before.steps
            step = (after.step_s - before.step_s) / max(steps, 1)
            running = (after.outputs - before.outputs) / max(steps, 1)  # sequences a step decodes, on average
            floor = (weights + running * (prompt + tokens / 2) * position) / rate
            rows.append([n, n * tokens / elapsed, step, floor, running])
    return [[f"{start_up:.1f} s start-up, {weights / 2**30:.2f} GiB of weights, {rate / 1e12:.2f} TB/s"]] + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=[*SIZES, "1b"], default="small")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        llama = checkpoint(Path(folder), args.size, args.dtype, args.max_length)
        reference = theirs(llama, args.dtype, args.concurrency, args.tokens)
        (setup,), *rows = ours(llama, args.dtype, args.concurrency, args.tokens, args.max_length)
    device = jax.devices()[0]
    print(f"# {args.size} Llama-shaped checkpoint in {args.dtype} on {device.platform} ({device.device_kind}), "
          f"{args.tokens} outputs per request; jitserve {setup}; transformers {torch.__version__} on "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
    header = ["concurrent", "jitserve tok/s", "transformers tok/s", "ratio", "decode step", "floor",
              "step / floor", "sequences per step"]
    table = [[f"{n}", f"{rate:,.0f}", f"{reference[n]:,.0f}", f"{rate / reference[n]:.2f}x", f"{step * 1e3:.2f} ms",
              f"{floor * 1e3:.2f} ms", f"{step / floor:.1f}x", f"{running:.1f}"]
             for n, rate, step, floor, running in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
