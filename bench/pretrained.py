"""Checkpoints served by ``js.from_pretrained`` against ``transformers`` on the same checkpoint, in one run:
start-up time, generation tokens/s at equal concurrency (jitserve: N concurrent ``js.generate`` calls on a
server with N slots; transformers: ``generate`` of a batch of N prompts, greedy, on CPU torch) and encoder
rows/s at equal batch (a BERT classifier: ``js.batched_run`` of N texts against one forward of N texts).

The checkpoints are made here as the tests make theirs (``tests/models/checkpoints.py``: transformers'
``save_pretrained``, a tokenizer trained offline), at ``--size small`` (the test configs) or ``medium``
(a Llama of 8 layers, 512 wide, ~30 M parameters, and a BERT of 4 layers, 256 wide).

    python3 dev.py bench pretrained [--size medium] [--concurrency 1 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import jax
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import jitserve as js

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import checkpoints

SIZES = {"small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
         "medium": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8}}
PROMPT = "Once upon a time there was a little model that wanted to serve"


def make(folder: Path, size: str) -> tuple[Path, Path]:
    """A Llama-shaped causal LM and a BERT classifier of ``size``."""
    llama = checkpoints.llama(folder / "llama")
    if size != "small":  # the same maker, wider: rebuild the model from the saved config
        config = AutoModelForCausalLM.from_pretrained(llama).config
        for key, value in SIZES[size].items():
            setattr(config, key, value)
        config.num_attention_heads, config.num_key_value_heads = 8, 2
        config.head_dim = config.hidden_size // 8
        model = checkpoints.widen(AutoModelForCausalLM.from_config(config), 0, std=0.05)
        model.save_pretrained(llama)
    return llama, checkpoints.bert(folder / "bert")


def seconds(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def generation(folder: Path, concurrency: list[int], tokens: int) -> list[list[str]]:
    rows = []
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for n in concurrency:
        started, gen = seconds(lambda n=n: js.serve(js.from_pretrained(folder, slots=n), name=f"llm-{n}"))
        with gen:
            js.generate(f"llm-{n}", PROMPT, max_steps=2)
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                ours, _ = seconds(lambda: list(pool.map(lambda _: js.generate(f"llm-{n}", PROMPT, max_steps=tokens),
                                                        range(2 * n))))
        ids = tokenizer([PROMPT] * n, return_tensors="pt")
        with torch.no_grad():
            model.generate(**ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
            theirs, _ = seconds(lambda: [model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens,
                                                        do_sample=False) for _ in range(2)])
        ours_rate, theirs_rate = 2 * n * tokens / ours, 2 * n * tokens / theirs
        rows.append([f"generation, {n} concurrent", f"{ours_rate:,.0f} tok/s", f"{theirs_rate:,.0f} tok/s",
                     f"{ours_rate / theirs_rate:.2f}x", f"{started:.1f} s"])
    return rows


def encoder(folder: Path, batch: int, repeats: int = 20) -> list[str]:
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [" ".join(checkpoints.CORPUS[:2])] * batch
    started, server = seconds(lambda: js.serve(js.from_pretrained(folder, batch_size=batch), name="bert"))
    with server:
        js.batched_run("bert", texts)
        ours, _ = seconds(lambda: [js.batched_run("bert", texts) for _ in range(repeats)])
    with torch.no_grad():
        model(**tokenizer(texts, padding=True, return_tensors="pt"))
        theirs, _ = seconds(lambda: [model(**tokenizer(texts, padding=True, return_tensors="pt"))
                                     for _ in range(repeats)])
    ours_rate, theirs_rate = batch * repeats / ours, batch * repeats / theirs
    return [f"classification, batch {batch}", f"{ours_rate:,.0f} rows/s", f"{theirs_rate:,.0f} rows/s",
            f"{ours_rate / theirs_rate:.2f}x", f"{started:.1f} s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        llama, bert = make(Path(folder), args.size)
        rows = generation(llama, args.concurrency, args.tokens) + [encoder(bert, args.batch)]
    device = jax.devices()[0]
    print(f"# {args.size} checkpoints on {device.platform} ({device.device_kind}); transformers on CPU torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads)")
    header = ["workload", "jitserve", "transformers", "ratio", "jitserve start-up (load + compile)"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
