"""One text generation through its three streaming doors on the same ``jitserve serve --hf`` process, in one
run: OpenAI's ``/v1/completions`` (``stream``, server-sent events), Triton's ``generate_stream`` (server-sent
events) and the KServe gRPC stream (``ModelStreamInfer``, ``max_tokens`` as a tensor, as genai-perf's
``tensorrtllm`` back end sends it). Each door runs the same greedy requests (the same prompts, ``max_tokens``)
from N concurrent asyncio clients, the doors in turn for a few rounds; the table puts side by side the tokens
per second (every request's tokens, as OpenAI's ``usage`` counts them, over the door's wall time: the
rounds' median), the time to the first text piece (p50, p90) and the request latency (p50). The doors answer
the same text for each prompt, which the script checks. Loopback only, bounded: ``--requests`` per round,
concurrency and door.

The checkpoint is made here as the tests make theirs (``tests/models/checkpoints.py``: a Llama of two layers
of 64, its tokenizer trained offline); nothing is downloaded.

    python3 dev.py bench generation_doors [--concurrency 1 8] [--requests 16] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2 as httpx
import numpy as np
import tritonclient.grpc.aio as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import checkpoints

import netutil

MODEL = "llm"
PROMPTS = [line[:40] for line in checkpoints.CORPUS[:6]]  # distinct prompts: not one prefix-cache hit each time


class Answer:
    """One request's answer at the client: its text, seconds to its first piece and to its end."""

    def __init__(self, started: float) -> None:
        self.started, self.first, self.text = started, 0.0, ""

    def piece(self, text: str) -> None:
        if text and not self.text:
            self.first = time.perf_counter() - self.started
        self.text += text

    def end(self) -> Answer:
        self.latency = time.perf_counter() - self.started
        return self


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


async def openai_door(http: httpx.AsyncClient, port: int, prompt: str, tokens: int) -> Answer:
    answer = Answer(time.perf_counter())
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            for event in events([line]):
                answer.piece("".join(choice["text"] for choice in event["choices"]))
    return answer.end()


async def generate_door(http: httpx.AsyncClient, port: int, prompt: str, tokens: int) -> Answer:
    answer = Answer(time.perf_counter())
    body = {"text_input": prompt, "max_tokens": tokens}
    async with http.stream("POST", f"http://127.0.0.1:{port}/v2/models/{MODEL}/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            for event in events([line]):
                answer.piece(event["text_output"])
    return answer.end()


async def grpc_door(client: grpcclient.InferenceServerClient, prompt: str, tokens: int) -> Answer:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    steps = grpcclient.InferInput("max_tokens", [1], "INT32")
    steps.set_data_from_numpy(np.array([tokens], np.int32))

    async def one_request():
        yield {"model_name": MODEL, "inputs": [text, steps]}

    answer = Answer(time.perf_counter())
    async for result, error in client.stream_infer(one_request()):  # the stream ends after the last output
        if error is not None:
            raise error
        answer.piece(result.as_numpy("text_output").reshape(-1)[0].decode())
    return answer.end()


async def drive(call: Callable[[str], Awaitable[Answer]], concurrency: int, requests: int
                ) -> tuple[float, list[tuple[str, Answer]]]:
    """``requests`` calls from ``concurrency`` clients, each taking the next prompt; the wall time and the
    answers."""
    queue = list(range(requests))
    done: list[tuple[str, Answer]] = []

    async def client() -> None:
        while queue:
            prompt = PROMPTS[queue.pop() % len(PROMPTS)]
            done.append((prompt, await call(prompt)))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, done


def tokens_of(port: int, tokens: int) -> dict[str, int]:
    """Each prompt's generated tokens as OpenAI's ``usage`` counts them (greedy: the same through every door)."""
    counts = {}
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
        counts[prompt] = answer["usage"]["completion_tokens"]
    return counts


async def measure(port: int, grpc_port: int, concurrency: list[int], requests: int, tokens: int, rounds: int
                  ) -> list[list[str]]:
    counts = tokens_of(port, tokens)
    rows, texts = [], {}
    limits = httpx.Limits(max_connections=max(concurrency), max_keepalive_connections=max(concurrency))
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        doors = {"OpenAI /v1/completions (SSE)": lambda prompt: openai_door(http, port, prompt, tokens),
                 "generate_stream (SSE)": lambda prompt: generate_door(http, port, prompt, tokens),
                 "gRPC ModelStreamInfer": lambda prompt: grpc_door(grpc, prompt, tokens)}
        for n in concurrency:
            for call in doors.values():  # warm: n connections, each prompt's prefix, n prompts prefilled at once
                await drive(call, n, max(n, len(PROMPTS)))
            rates: dict[str, list[float]] = {door: [] for door in doors}
            answers: dict[str, list[Answer]] = {door: [] for door in doors}
            for _ in range(rounds):  # the doors in turn, so that the machine's moods fall on each alike
                for door, call in doors.items():
                    wall, done = await drive(call, n, requests)
                    rates[door].append(sum(counts[prompt] for prompt, _ in done) / wall)
                    answers[door] += [answer for _, answer in done]
                    for prompt, answer in done:
                        texts.setdefault(prompt, set()).add(answer.text)
            for door in doors:
                firsts = [answer.first * 1e3 for answer in answers[door]]
                latencies = [answer.latency * 1e3 for answer in answers[door]]
                rows.append([door, str(n), f"{statistics.median(rates[door]):,.0f}",
                             f"{statistics.median(firsts):.1f}", f"{np.percentile(firsts, 90):.1f}",
                             f"{statistics.median(latencies):.1f}"])
        await grpc.close()
    assert all(len(found) == 1 for found in texts.values()), f"the doors answered differently: {texts}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=16, help="requests per door and concurrency")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every door in turn (tokens/s: their median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        llama = checkpoints.llama(Path(folder) / "llama")
        started = time.perf_counter()
        running = netutil.start_server(f"--hf={llama}", "--name", MODEL)
        print(f"jitserve serve --hf: ready in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            rows = asyncio.run(measure(running.port, running.grpc_port, args.concurrency, args.requests,
                                       args.tokens, args.rounds))
        finally:
            netutil.stop(running)
    header = ["door", "clients", "tokens/s", "first piece p50 ms", "p90 ms", "latency p50 ms"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * width for width in widths], *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    print(f"(each row: {args.rounds} rounds of {args.requests} greedy requests of max_tokens {args.tokens}, the "
          f"doors in turn; tokens/s the rounds' median; the same text for each prompt through every door)")


if __name__ == "__main__":
    main()
