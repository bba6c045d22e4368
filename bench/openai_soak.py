"""A bounded soak of the OpenAI door (issue 56): well-behaved and hostile clients at once against a real
``jitserve serve`` of a small Llama checkpoint, its weights reloaded mid-run, and whether the server's memory,
descriptors and KV blocks come back.

The checkpoint is made here as the tests make theirs (``tests/models/checkpoints.py``: a Llama of two layers
of 64, its tokenizer trained offline, with a chat template; nothing is downloaded) and served from a model
repository (``--model-repository DIR --model-control-mode explicit --load-model llm``), so that a load of it
reloads it. For ``--seconds`` (120):

- ``--clients`` (8) well-behaved clients (the ``openai`` SDK, no retries) send, in turn, completions and
  chats, streamed and not, with ``n`` from 1 to 4 and now and then ``n`` at its limit (``MAX_CHOICES``, 128),
  ``logprobs`` / ``top_logprobs``, ``stream_options`` with vLLM's ``continuous_usage_stats``; every answer is
  checked (its choices, its usage, its log-probabilities, a usage on every streamed chunk);
- ``--hostile`` (2) clients open streams and close their connection after the headers, after 2 chunks or after
  10, and send requests with bad fields (each must be a 400, an unknown model a 404);
- at a third and at two thirds of the run the checkpoint's weights are changed (same names, shapes and
  dtypes) and ``POST /v2/repository/models/llm/load`` reloads it; a greedy probe longer than a few KV blocks,
  sent before and after each reload (so that the prefix cache holds it under the old weights), must change
  with the weights and, after the last reload, equal a fresh server's answer on those weights (started after
  the soak).

The server's resident memory, open descriptors (``/proc/PID/fd``), threads and paged KV blocks used (its
``/metrics``, ``jitserve_generation_kv_blocks_used``) are read at the start (after a warm-up of every kind of
request and a settle), every half second through the run (the peak) and after it (after a settle). It prints
one table (measure | start | peak | after | after vs start; goal: back within 5 %) and the requests by kind;
it exits 1 when a well-behaved request failed, a bad request was not refused with its 4xx, a reload failed,
the probe did not change or differs from the fresh server's, the log holds a traceback, or a measure did not
come back. Loopback only; bounded in time and count.

    python3 dev.py bench openai_soak [--seconds 120] [--clients 8] [--hostile 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
from safetensors.numpy import load_file, save_file

from jitserve.protocol.openai_request import MAX_CHOICES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import checkpoints

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llm"
PROMPTS = [line[:48] for line in checkpoints.CORPUS[:6]]
# the greedy probe, longer than a few KV blocks of 16 so that the prefix cache holds it across a reload: its
# text changes when the weights do, and after the last reload equals a fresh server's on those weights
PROBE = " ".join(checkpoints.CORPUS[:2])
SLOW = 600.0  # a bound for one call on a busy machine: it catches a hang, it times nothing
SETTLE_S = 5.0
BACK = 0.05  # after vs start: the goal
BAD = [  # (endpoint, body, status): requests with bad fields, each refused
    ("completions", {"prompt": "x", "max_tokens": 4, "bogus": 1}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "n": MAX_CHOICES + 1}, 400),
    ("completions", {"prompt": ["x", "y"], "max_tokens": 4, "n": MAX_CHOICES // 2 + 1}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "n": 0}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "logprobs": 99}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "temperature": -1}, 400),
    ("completions", {"prompt": "x", "max_tokens": -5}, 400),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("completions", {"max_tokens": 4}, 400),
    ("completions", {"prompt": [10**6], "max_tokens": 4}, 400),
    ("completions", {"prompt": "x", "max_tokens": 10**6}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "suffix": "y"}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"nope": True}}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "stream": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": 1}}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {"1" * 5000: 1}}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "model": "nope"}, 404),
    ("completions", b'{"prompt": "x", "max_tok', 400),
    ("chat/completions", {"messages": "hi", "max_tokens": 4}, 400),
    ("chat/completions", {"messages": [{"role": "user"}], "max_tokens": 4}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": MAX_CHOICES + 1}, 400),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_usage(pid: int) -> dict[str, float]:
    """Resident memory (MiB), threads and open descriptors of ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"RSS MiB": int(status["VmRSS"].split()[0]) / 1024, "open descriptors": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


async def kv_blocks_used(http: httpx.AsyncClient) -> float:
    metrics = (await http.get("/metrics")).text
    found = re.search(rf'jitserve_generation_kv_blocks_used\{{model="{MODEL}",version="1"\}} (\S+)', metrics)
    return float(found.group(1)) if found else float("nan")


async def measure(pid: int, http: httpx.AsyncClient) -> dict[str, float]:
    return {**process_usage(pid), "KV blocks used": await kv_blocks_used(http)}


def checked(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


class Tally:
    def __init__(self) -> None:
        self.sent = collections.Counter()  # kind -> requests sent
        self.ok = collections.Counter()
        self.failed = collections.Counter()  # kind: reason -> count
        self.choices = 0
        self.chunks = 0
        self.hostile = collections.Counter()  # what -> count
        self.wrong = collections.Counter()  # bad request answered other than refused: case: status -> count


async def well_behaved(client: openai.AsyncOpenAI, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    """One client: the kinds of request in turn, every answer checked."""
    rng = random.Random(seed)
    turn = 0
    while not stop.is_set():
        kind = ["completion", "completion stream", "chat", "chat stream"][turn % 4]
        n = rng.randint(1, 4)
        if turn % 16 == 15:
            kind, n = "completion n=128", MAX_CHOICES
        prompt = rng.choice(PROMPTS)
        turn += 1
        tally.sent[kind] += 1
        try:
            await one_request(client, kind, n, prompt, rng, tally)
            tally.ok[kind] += 1
        except Exception as error:  # what failed is what is counted
            tally.failed[f"{kind}: {type(error).__name__}: {str(error)[:100]}"] += 1


async def one_request(client: openai.AsyncOpenAI, kind: str, n: int, prompt: str, rng: random.Random,
                      tally: Tally) -> None:
    tokens = 4 if n == MAX_CHOICES else rng.randint(4, 24)
    sampling = {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31)}
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind.startswith("completion") and "stream" not in kind:
        logprobs = None if n == MAX_CHOICES else rng.randint(0, 5)
        answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, n=n,
                                                 logprobs=logprobs, **sampling)
        checked(len(answer.choices) == n and sorted(c.index for c in answer.choices) == list(range(n)),
                f"{len(answer.choices)} choices for n={n}")
        checked(answer.usage.completion_tokens <= n * tokens, "completion_tokens past n x max_tokens")
        if logprobs is not None:
            checked(all(c.logprobs and len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
                        for c in answer.choices), "a choice without its logprobs")
        tally.choices += n
    elif kind == "completion stream":
        seen: dict[int, int] = collections.Counter()
        done = False
        async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, n=n,
                                                           logprobs=1, stream=True,
                                                           extra_body={"stream_options": options}, **sampling):
            tally.chunks += 1
            checked(chunk.usage is not None, "a chunk without its usage (continuous_usage_stats)")
            for c in chunk.choices:
                seen[c.index] += 1
            done = done or (not chunk.choices)
        checked(sorted(seen) == list(range(n)) and done, f"stream: choices {sorted(seen)} for n={n}, usage {done}")
        tally.choices += n
    elif kind == "chat":
        top = rng.randint(0, 5)
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
            max_tokens=tokens, n=n, logprobs=True, top_logprobs=top, **sampling)
        checked(len(answer.choices) == n, f"{len(answer.choices)} choices for n={n}")
        checked(all(c.logprobs and c.logprobs.content and all(len(t.top_logprobs) == top for t in c.logprobs.content)
                    for c in answer.choices), "a chat choice without its top_logprobs")
        tally.choices += n
    else:  # chat stream
        seen = collections.Counter()
        finished = set()
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, n=n, stream=True,
                extra_body={"stream_options": options}, **sampling):
            tally.chunks += 1
            checked(chunk.usage is not None, "a chat chunk without its usage (continuous_usage_stats)")
            for c in chunk.choices:
                seen[c.index] += 1
                if c.finish_reason:
                    finished.add(c.index)
        checked(finished == set(range(n)), f"chat stream: finished {sorted(finished)} for n={n}")
        tally.choices += n


async def abandon(port: int, rng: random.Random, tally: Tally) -> None:
    """A stream opened and left: the connection closed after the headers, after 2 chunks or after 10."""
    after = rng.choice([0, 2, 10])
    n = rng.randint(1, 8)
    chat = rng.random() < 0.5
    body = ({"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]} if chat
            else {"prompt": rng.choice(PROMPTS)}) | {"model": MODEL, "max_tokens": 128, "n": n, "stream": True,
                                                     "temperature": 1.0}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=SLOW) as http:  # its own connection
        async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
            if response.status_code != 200:
                tally.hostile[f"abandoned stream answered {response.status_code}"] += 1
                return
            read = 0
            async for line in response.aiter_lines():
                if read >= after:
                    break
                read += line.startswith("data: ")
    tally.hostile[f"streams abandoned after {after} chunks"] += 1


async def refused(http: httpx.AsyncClient, case: int, tally: Tally) -> None:
    endpoint, body, status = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL} | body).encode()
    response = await http.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
    tally.hostile[f"bad requests answered {response.status_code}"] += 1
    if response.status_code != status:
        shown = content[:60].decode(errors="replace")
        tally.wrong[f"{endpoint} {shown}: {response.status_code} (not {status}) {response.text[:80]}"] += 1


async def hostile(port: int, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    turn = 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=SLOW) as http:
        while not stop.is_set():
            try:
                if turn % 2 == 0:
                    await abandon(port, rng, tally)
                else:
                    await refused(http, rng.randrange(len(BAD)), tally)
            except Exception as error:  # a hostile client's own failures are counted, not raised
                tally.hostile[f"hostile client's error {type(error).__name__}"] += 1
            turn += 1
            await asyncio.sleep(0.05)


def change_weights(folder: Path, seed: int) -> None:
    """Every weight of the checkpoint moved by seeded noise: the same names, shapes and dtypes."""
    rng = np.random.default_rng(seed)
    for path in folder.glob("*.safetensors"):
        weights = load_file(path)
        save_file({name: (value + rng.normal(0, 0.05, value.shape)).astype(value.dtype)
                   for name, value in weights.items()}, path, metadata={"format": "pt"})


async def probe(client: openai.AsyncOpenAI) -> str:
    answer = await client.completions.create(model=MODEL, prompt=PROBE, max_tokens=12, temperature=0)
    return answer.choices[0].text


async def soak(args, port: int, pid: int, folder: Path) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                timeout=SLOW)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=SLOW)
    warm = Tally()  # the warm-up: every kind once, a stream left, every bad request once
    rng = random.Random(0)
    for kind in ["completion", "completion stream", "chat", "chat stream"]:
        await one_request(client, kind, 2, PROMPTS[0], rng, warm)
    await one_request(client, "completion n=128", MAX_CHOICES, PROMPTS[1], rng, warm)
    for after in range(3):
        await abandon(port, random.Random(after), warm)
    for case in range(len(BAD)):
        await refused(http, case, warm)
    texts = [await probe(client)]  # texts: before, before, after, before, after the reloads
    await asyncio.sleep(SETTLE_S)
    start = await measure(pid, http)
    peak = dict(start)
    tally, stop = Tally(), asyncio.Event()
    reloads: list[tuple[int, float]] = []
    began = time.monotonic()
    tasks = [asyncio.create_task(well_behaved(client, i, stop, tally)) for i in range(args.clients)]
    tasks += [asyncio.create_task(hostile(port, 1000 + i, stop, tally)) for i in range(args.hostile)]

    async def sample() -> None:
        while not stop.is_set():
            for name, value in (await measure(pid, http)).items():
                peak[name] = max(peak[name], value)
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    for turn in (1, 2):
        await asyncio.sleep(max(0.0, began + args.seconds * turn / 3 - time.monotonic()))
        texts.append(await probe(client))  # its prefix cached under the weights before the reload
        await asyncio.to_thread(change_weights, folder, turn)
        sent = time.monotonic()
        status = (await http.post(f"/v2/repository/models/{MODEL}/load", json={})).status_code
        reloads.append((status, time.monotonic() - sent))
        texts.append(await probe(client))
    await asyncio.sleep(max(0.0, began + args.seconds - time.monotonic()))
    stop.set()
    ran = time.monotonic() - began
    await asyncio.wait_for(asyncio.gather(*tasks), SLOW)
    await sampler
    await asyncio.sleep(SETTLE_S)
    after = await measure(pid, http)
    await http.aclose()
    await client.close()
    return {"start": start, "peak": peak, "after": after, "tally": tally, "reloads": reloads, "texts": texts,
            "ran": ran, "warm": warm}


class Server:
    """``jitserve serve`` of the repository on loopback ports, its output in ``log``; ready once it answers."""

    def __init__(self, repository: Path, log: Path, cache: Path) -> None:
        self.port, self.log = free_port(), log
        started = time.monotonic()
        with log.open("w") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jitserve", "serve", f"--model-repository={repository}",
                 "--model-control-mode", "explicit", "--load-model", MODEL, "--host", "127.0.0.1", "--port",
                 str(self.port), "--grpc-port", str(free_port())], cwd=ROOT, stdout=output,
                stderr=subprocess.STDOUT, env={**os.environ, "JITSERVE_CACHE_DIR": str(cache)})
        while True:
            if self.process.poll() is not None or time.monotonic() - started > SLOW:
                self.stop()
                raise SystemExit(f"jitserve serve did not become ready:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/v2/models/{MODEL}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        self.ready_s = time.monotonic() - started

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return self.log.read_text()


async def fresh_probe(port: int) -> str:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=SLOW)
    try:
        return await probe(client)
    finally:
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--clients", type=int, default=8, help="well-behaved clients")
    parser.add_argument("--hostile", type=int, default=2, help="clients that leave streams and send bad fields")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository, cache = Path(scratch) / "repository", Path(scratch) / "compile-cache"
        folder = checkpoints.llama(repository / MODEL)
        server = Server(repository, Path(scratch) / "server.log", cache)
        print(f"# jitserve serve --model-repository (a Llama of 2 layers of 64, paged KV, prefix cache): ready in "
              f"{server.ready_s:.0f} s", flush=True)
        try:
            found = asyncio.run(soak(args, server.port, server.process.pid, folder))
        finally:
            logged = server.stop()
        fresh = Server(repository, Path(scratch) / "fresh.log", cache)  # the last weights, nothing cached
        try:
            found["fresh"] = asyncio.run(fresh_probe(fresh.port))
        finally:
            fresh.stop()
    return report(args, found, logged)


def report(args, found: dict, logged: str) -> int:
    start, peak, after, tally = found["start"], found["peak"], found["after"], found["tally"]
    rows = []
    problems = []
    for name in start:
        moved = after[name] - start[name]
        within = abs(moved) <= BACK * start[name] if start[name] else moved == 0
        shown = f"{moved:+.1f}" + (f" ({moved / start[name]:+.1%})" if start[name] else "")
        rows.append([name, f"{start[name]:.0f}", f"{peak[name]:.0f}", f"{after[name]:.0f}",
                     shown + ("" if within else " NOT BACK")])
        if not within:
            problems.append(f"{name} not back within {BACK:.0%}")
    header = ["measure", "start", "peak", "after", "after vs start"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print(f"# {found['ran']:.0f} s, {args.clients} well-behaved clients (openai SDK), {args.hostile} hostile; "
          f"measured after a warm-up and {SETTLE_S:.0f} s settle, every 0.5 s, and {SETTLE_S:.0f} s after")
    for row in [header, ["-" * width for width in widths], *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    sent, ok, failed = sum(tally.sent.values()), sum(tally.ok.values()), sum(tally.failed.values())
    print(f"well-behaved requests: sent {sent:,}, succeeded {ok:,}, failed {failed:,} ("
          + ", ".join(f"{kind} {tally.ok[kind]:,}/{tally.sent[kind]:,}" for kind in sorted(tally.sent))
          + f"); choices {tally.choices:,}, streamed chunks {tally.chunks:,}")
    for reason, count in sorted(tally.failed.items()):
        print(f"  FAILED x{count}: {reason}")
    print("hostile: " + ", ".join(f"{what} {count:,}" for what, count in sorted(tally.hostile.items())))
    for what, count in sorted(tally.wrong.items()):
        print(f"  NOT REFUSED AS EXPECTED x{count}: {what}")
    for what, count in sorted(found["warm"].wrong.items()):
        print(f"  (warm-up) NOT REFUSED AS EXPECTED x{count}: {what}")
    swapped = len(re.findall(rf"model '{MODEL}' reloaded: new weights, nothing compiled", logged))
    print("reloads (changed weights): " + ", ".join(f"{status} in {seconds:.2f} s" for status, seconds in
                                                   found["reloads"])
          + f"; weights-only swaps logged {swapped}")
    texts = found["texts"]
    print(f"greedy probe ({len(PROBE)} characters, prefix-cached): {len(set(texts[:2]))} text before the first "
          f"reload, {len(set(texts[2:4]))} after it, {len(set(texts[4:]))} after the second; after the second "
          f"{'equals' if texts[-1] == found['fresh'] else 'DIFFERS FROM'} a fresh server's on the same weights")
    tracebacks = logged.count("Traceback")
    print(f"server log: {tracebacks} tracebacks")
    problems += [f"{failed} well-behaved requests failed"] if failed else []
    problems += ["a bad request was not refused with its 4xx"] if tally.wrong or found["warm"].wrong else []
    problems += ["a reload failed"] if any(status != 200 for status, _ in found["reloads"]) else []
    problems += ["the probe's text did not change with the weights"] if len(set(texts)) != 3 or len(
        {texts[0], texts[2], texts[4]}) != 3 else []
    problems += ["after the reload the probe differs from a fresh server's"] if texts[-1] != found["fresh"] else []
    problems += [f"{tracebacks} tracebacks in the server's log"] if tracebacks else []
    print("OK" if not problems else "PROBLEMS: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
