"""genai-perf (Triton's LLM benchmark, from PyPI; no one here wrote it) against a real ``jitserve serve --hf
DIR`` on loopback, each run to a finished profile: over the KServe gRPC stream as its ``vllm`` back end
sends requests (``sampling_parameters``) and as its ``tensorrtllm`` back end does (``max_tokens`` and, with
``--output-tokens-mean-deterministic``, ``min_length`` as tensors), over Triton's generate extension
(``generate_stream``), and over OpenAI's API (chat, streamed, and completions). A checkpoint made here and
its tokenizer (``--tokenizer DIR``): nothing is downloaded.

Each run is bounded (a few requests of a few prompt and output tokens, concurrency 1 to 4); its report
counts every request and a token throughput above 0, and every request's answer stops at the
``max_tokens`` genai-perf asked for (the server's default is more). The same greedy text comes back for the
same prompt through every door that neither adds a chat template nor holds the end token back.
genai-perf drives perf_analyzer, which ``python3 dev.py test`` installs
(``netutil.perf_analyzer_environment``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from subprocess import run
from typing import Any

import pytest

from netutil import perf_analyzer_environment, start_server, stop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the checkpoints the model tests make
import checkpoints

MODEL = "gpt"
TOKENS = 3  # output tokens asked for: the server's default (16) would give more
REQUESTS = 6
# run -> (genai-perf's arguments, the door: "grpc" or "http", its concurrency)
RUNS: dict[str, tuple[list[str], str, int]] = {
    "kserve-vllm": (["--endpoint-type", "kserve", "--backend", "vllm", "--streaming"], "grpc", 2),
    # --output-tokens-mean-deterministic: min_length (TensorRT-LLM's min_tokens) as a tensor too
    "kserve-tensorrtllm": (["--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming",
                            "--output-tokens-mean-deterministic"], "grpc", 4),
    "generate-stream": (["--endpoint-type", "generate", "--endpoint", f"v2/models/{MODEL}/generate_stream",
                         "--streaming"], "http", 1),
    # sampled (OpenAI's default temperature): min_tokens (vLLM's) so that no answer is an end token alone, which
    # genai-perf leaves out of its count (about 1 sampled answer in 100 of this random checkpoint)
    "openai-chat": (["--endpoint-type", "chat", "--streaming", "--extra-inputs", f"min_tokens:{TOKENS}"], "http", 3),
    "openai-completions": (["--endpoint-type", "completions", "--extra-inputs", "temperature:0"], "http", 2),
}
GREEDY_ALIKE = ("kserve-vllm", "generate-stream", "openai-completions")  # min_length may change a text


class Profile:
    """A finished genai-perf run: its summary (profile_export_genai_perf.json) and each request's prompt
    with the text pieces that answered it (profile_export.json, perf_analyzer's record)."""

    def __init__(self, folder: Path) -> None:
        (summary,) = folder.glob("*/profile_export_genai_perf.json")
        self.summary = json.loads(summary.read_text())
        (record,) = folder.glob("*/profile_export.json")
        requests = json.loads(record.read_text())["experiments"][0]["requests"]
        self.answers = [(prompt_of(request["request_inputs"]), [piece for response in request["response_outputs"]
                                                                for piece in pieces(response)])
                        for request in requests]


def prompt_of(inputs: dict[str, Any]) -> str:
    """A request's prompt: the ``text_input`` tensor, or in an HTTP body ``text_input`` or ``prompt``."""
    if "payload" not in inputs:
        return inputs["text_input"]
    body = json.loads(inputs["payload"])
    prompt = body.get("text_input", body.get("prompt", body.get("messages")))
    return json.dumps(prompt) if isinstance(prompt, list) and isinstance(prompt[0], dict) else prompt[0]


def pieces(response: dict[str, Any]) -> list[str]:
    """The text of one response: a tensor ``text_output``, or an HTTP body (server-sent events or JSON) of
    the generate extension or OpenAI."""
    if "text_output" in response:
        return [response["text_output"]] if response["text_output"] else []
    body = response["response"]
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")] or [body]
    found = []
    for event in events:
        if not event.strip() or event == "[DONE]":
            continue
        answer = json.loads(event)
        if "text_output" in answer:
            found.append(answer["text_output"])
        for choice in answer.get("choices", []):
            found.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return [text for text in found if text]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """GPT-2's layout, two layers of 64, 64 positions (a short warm-up), with its tokenizer."""
    return checkpoints.gpt2(tmp_path_factory.mktemp("genai-perf") / "gpt2", positions=64)


@pytest.fixture(scope="module")
def server(folder):
    running = start_server(f"--hf={folder}", "--name", MODEL)
    yield running
    assert "Traceback" not in stop(running)


@pytest.fixture(scope="module")
def profiled(server, folder, tmp_path_factory):
    """``profiled(run)``: genai-perf's finished profile of ``run`` (a key of RUNS), run on first use."""
    done: dict[str, Profile] = {}

    def profile(name: str) -> Profile:
        if name not in done:
            arguments, door, concurrency = RUNS[name]
            artifacts = tmp_path_factory.mktemp(name)
            port = server.grpc_port if door == "grpc" else server.port
            finished = run(
                [str(Path(sys.executable).with_name("genai-perf")), "profile", "-m", MODEL, "-u",
                 f"127.0.0.1:{port}", "--tokenizer", str(folder), "--synthetic-input-tokens-mean", "8",
                 "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(TOKENS),
                 "--output-tokens-stddev", "0", "--request-count", str(REQUESTS), "--concurrency",
                 str(concurrency), "--random-seed", "0", "--artifact-dir", str(artifacts), *arguments],
                cwd=artifacts, capture_output=True, text=True, timeout=300,
                env={**perf_analyzer_environment(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
            assert finished.returncode == 0, finished.stdout[-6000:] + finished.stderr[-6000:]
            done[name] = Profile(artifacts)
        return done[name]
    return profile


@pytest.mark.parametrize("name", RUNS)
def test_genai_perf_profiles_the_generation_to_the_end(profiled, name):
    profile = profiled(name)
    assert profile.summary["request_count"]["avg"] == REQUESTS
    assert profile.summary["output_token_throughput"]["avg"] > 0
    assert profile.summary["request_throughput"]["avg"] > 0
    if "--streaming" in RUNS[name][0]:
        assert profile.summary["time_to_first_token"]["avg"] > 0
    assert len(profile.answers) == REQUESTS
    for prompt, answer in profile.answers:
        assert 1 <= len(answer) <= TOKENS, (prompt, answer)  # a piece per token at most: max_tokens was heard


def test_every_door_gives_the_same_greedy_text_for_the_same_prompt(profiled):
    texts = {name: {prompt: "".join(answer) for prompt, answer in profiled(name).answers} for name in GREEDY_ALIKE}
    first = texts[GREEDY_ALIKE[0]]
    assert len(first) > 1
    for name in GREEDY_ALIKE[1:]:
        assert texts[name] == first, name
