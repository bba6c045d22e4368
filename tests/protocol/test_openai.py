"""OpenAI's API on jitserve's HTTP port, driven by the official ``openai`` SDK against real servers on loopback:
checkpoints made here (tests/models/checkpoints.py), one with a Llama 3-style chat template that writes its
own BOS, one with a ChatML-style template, one without a template, and a BERT encoder. Completions and chat,
streamed and not, equal the in-process ``js.generate`` of the same engine and ``transformers``' greedy
decoding of ``apply_chat_template``'s tokens; ``usage`` counts the tokenizer's tokens; ``n``, ``seed``,
``stop``, ``echo``; what clients send by default (vLLM's continuous usage in a stream, ``best_of`` equal to
``n``, ``parallel_tool_calls`` without tools, vLLM's ``/tokenizer_info``); embeddings equal the in-process serving's; errors in OpenAI's
shape (a wrong model 404, a bad key 401, an unsupported parameter 400 naming it); and the README's example
against `jitserve serve`."""

from __future__ import annotations

import base64
import http.client
import json
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import jitserve as js
from jitserve.protocol import app
from jitserve.protocol.access import Access
from jitserve.protocol.service import InferenceService
from netutil import ROOT, free_port, http_front, start_server, stop
from waiting import until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the checkpoints the model tests make
import checkpoints

KEY = "sk-test"
ORIGIN = "https://chat.example"  # a browser page's, admitted by the server's CORS
PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓ there"}]
# Llama 3's shape: the template writes the BOS itself (the tokenizer would add one more if asked to)
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen2's way


def with_chat_template(folder: Path, template: str | None) -> Path:
    """``folder``'s tokenizer with ``template`` as its chat template (None: without one)."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    llama3 = with_chat_template(checkpoints.llama(root / "llama3", heads=4, kv_heads=4, tied=True, seed=2),
                                LLAMA3_TEMPLATE)
    return {"llama3": llama3,
            "chatml": with_chat_template(checkpoints.gpt2(root / "chatml"), CHATML_TEMPLATE),
            "plain": with_chat_template(Path(shutil.copytree(llama3, root / "plain")), None),
            "embed": checkpoints.bert(root / "embed", "embedding")}


class Served:
    def __init__(self, port: int, servers: dict) -> None:
        self.port, self.servers = port, servers

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def post(self, path: str, payload: dict | bytes, key: str | None = KEY) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request("POST", path, payload if isinstance(payload, bytes) else json.dumps(payload).encode(),
                               {"Authorization": f"Bearer {key}"} if key else {})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def served(folders):
    """Every model served in this process (js.serve) behind jitserve's HTTP front with an API key: the
    OpenAI, KServe and in-process callers of a model share its one engine."""
    models = {"llama3": js.from_pretrained(folders["llama3"], slots=4, max_length=64),
              "chatml": js.from_pretrained(folders["chatml"], slots=2, max_length=128),
              "plain": js.from_pretrained(folders["plain"], slots=1, max_length=16),
              "embed": js.from_pretrained(folders["embed"], task="embedding", max_length=32, batch_size=2),
              "mlp": js.Serving(lambda x: x * 2, input_template=js.template((4,), "float32"))}
    servers = {name: js.serve(model, name=name) for name, model in models.items()}
    port = free_port()
    with http_front(app.http_config(InferenceService(servers), "127.0.0.1", port, access=Access(KEY, (ORIGIN,)))):
        yield Served(port, servers)
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def hf_greedy(folder: Path, ids: list[int], steps: int) -> tuple[str, int]:
    """transformers' greedy continuation of token ``ids``: its text and how many tokens it generated (an end
    token included)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def chat_ids(folder: Path, messages: list[dict]) -> list[int]:
    encoded = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_models_lists_the_text_generations_and_embedding_models(client):
    listed = client.models.list().data
    assert sorted(model.id for model in listed) == ["chatml", "embed", "llama3", "plain"], "not the MLP"
    assert all(model.object == "model" and model.owned_by == "jitserve" and model.created > 0 for model in listed)
    assert client.models.retrieve("llama3").id == "llama3"
    assert {model.id: getattr(model, "max_model_len", None) for model in listed} == \
        {"llama3": 64, "chatml": 128, "plain": 16, "embed": None}, "a generation's length, as vLLM lists it"
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("mlp")
    assert refused.value.code == "model_not_found" and "is not served by the OpenAI API" in refused.value.message
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.models.retrieve("nope")


def test_vllms_health_path_answers_without_the_key_as_live_does(served):
    """Probes set up for vLLM (or TGI) ask ``GET /health``; like KServe's ``/v2/health/live``, it needs no key."""
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/health", timeout=30) as answer:
        assert answer.status == 200 and json.loads(answer.read()) == {"live": True}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{served.port}/v1/models", timeout=30)
    assert refused.value.code == 401, "the rest still needs it"


def test_a_greedy_completion_is_the_in_process_generation_of_the_same_engine(served, client, folders):
    expected = js.generate("llama3", PROMPT, max_steps=8)  # in process, on the server the HTTP front uses
    answer = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=8, temperature=0)
    (choice,) = answer.choices
    assert (choice.text, choice.finish_reason, choice.index) == (expected, "length", 0)
    assert answer.object == "text_completion" and answer.model == "llama3" and answer.id.startswith("cmpl-")
    prompt_ids = AutoTokenizer.from_pretrained(folders["llama3"])(PROMPT)["input_ids"]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (len(prompt_ids), 8, len(prompt_ids) + 8)
    assert hf_greedy(folders["llama3"], prompt_ids, 8) == (expected, 8)
    by_ids = client.completions.create(model="llama3", prompt=prompt_ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == expected, "a prompt given as token ids"
    echoed = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected


@pytest.mark.parametrize("model", ["llama3", "chatml"])
def test_chat_renders_the_chat_template_as_transformers_and_generates_its_greedy_text(client, folders, model):
    ids = chat_ids(folders[model], MESSAGES)
    bos = AutoTokenizer.from_pretrained(folders[model]).bos_token_id
    if model == "llama3":
        assert ids.count(bos) == 1, "the template's own BOS and no second one"
    text, generated = hf_greedy(folders[model], ids, 10)
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if generated == 10 else "stop")
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), generated)
    parts = [{**MESSAGES[0], "content": [{"type": "text", "text": "Be brief."}]}, MESSAGES[1]]
    assert client.chat.completions.create(model=model, messages=parts, max_tokens=10,
                                          temperature=0).choices[0].message.content == text, "content as text parts"


@pytest.mark.parametrize("model", ["llama3", "chatml"])
def test_an_assistants_message_without_content_is_rendered_empty_as_vllm_renders_it(client, folders, model):
    """An assistant's message that made tool calls has content null: its template gets "" (as vLLM gives it),
    neither the text "None" nor a TypeError (ChatML's template adds the content to strings)."""
    after_a_tool_call = [MESSAGES[1], {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]
    answer = client.chat.completions.create(model=model, messages=after_a_tool_call, max_tokens=2, temperature=0)
    rendered = chat_ids(folders[model], [MESSAGES[1], {"role": "assistant", "content": ""}, after_a_tool_call[2]])
    assert answer.usage.prompt_tokens == len(rendered)


def test_streams_are_chunks_that_join_to_the_whole_answer_then_done(served, client):
    whole = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="llama3", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1

    chat = client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=6, temperature=0)
    deltas = [c.choices[0] for c in client.chat.completions.create(
        model="llama3", messages=MESSAGES, max_tokens=6, temperature=0, stream=True)]
    assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
    assert "".join(d.delta.content or "" for d in deltas) == chat.choices[0].message.content
    assert deltas[-1].finish_reason == chat.choices[0].finish_reason and deltas[-1].delta.content is None

    status, body = served.post("/v1/chat/completions", {"model": "llama3", "messages": MESSAGES, "max_tokens": 3,
                                                        "stream": True})
    events = body.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""], "the stream ends in [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "chat.completion.chunk" for e in events[:-2])


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_as_vllm_does(served, client):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it by default), read as vLLM reads it:
    with ``include_usage``, every chunk with a choice carries that choice's usage so far (its prompt's tokens
    and those it generated), its last one the choice's whole count; without ``include_usage``, no usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    whole = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="llama3", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"stream_options": options}))
    counted = [c.usage for c in chunks if c.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage and all(counted)
    assert {u.prompt_tokens for u in counted} == {whole.usage.prompt_tokens}
    assert [u.completion_tokens for u in counted] == sorted(u.completion_tokens for u in counted)
    assert counted[-1] == whole.usage and all(u.total_tokens == u.prompt_tokens + u.completion_tokens
                                              for u in counted)

    asked = {"model": "llama3", "messages": MESSAGES, "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 2}
    chat = list(client.chat.completions.create(stream=True, extra_body={"stream_options": options}, **asked))
    last = {c.choices[0].index: c.usage.completion_tokens for c in chat if c.choices}  # each choice's last chunk
    assert chat[-1].usage.completion_tokens == sum(last.values()) and set(last) == {0, 1}
    assert chat[-1].usage.prompt_tokens == chat[0].usage.prompt_tokens, "the prompt counted once in the total"
    alone = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **asked))
    assert all(c.usage is None for c in alone[:-1]) and alone[-1].usage == chat[-1].usage
    quiet = list(client.chat.completions.create(stream=True, extra_body={"stream_options": {
        "continuous_usage_stats": True}}, **asked))
    assert all(c.usage is None for c in quiet), "continuous_usage_stats goes with include_usage, as in vLLM"
    for wrong, message in [({"continuous_usage_stats": 1}, "'continuous_usage_stats' must be true or false, got 1"),
                           ({"include_usage": True, "per_token": True}, "'stream_options' takes "
                            "continuous_usage_stats, include_usage (each true or false); got "
                            '{"include_usage":true,"per_token":true}')]:
        status, body = served.post("/v1/completions", {"model": "llama3", "prompt": PROMPT, "stream": True,
                                                       "stream_options": wrong})
        assert status == 400 and json.loads(body)["error"]["message"] == message


def test_best_of_equal_to_n_is_taken_and_any_other_refused_by_name(client):
    """``best_of`` (LlamaIndex and benchmark clients send 1): equal to ``n`` it asks for every choice generated,
    which is what jitserve returns; any other value is refused by name (vLLM V1 does not support best_of)."""
    asked = {"model": "llama3", "prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "seed": 5}
    two = client.completions.create(n=2, **asked)
    assert [c.text for c in client.completions.create(n=2, best_of=2, **asked).choices] == [c.text for c in two.choices]
    assert len(client.completions.create(best_of=1, **asked).choices) == 1
    for n, best_of, shown in [(2, 3, "3"), (2, 1, "1"), (None, 2, "2"), (None, True, "true"), (None, 1.0, "1.0")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**asked, **({} if n is None else {"n": n}), extra_body={"best_of": best_of})
        assert (refused.value.param, refused.value.code) == ("best_of", "unsupported_parameter")
        assert refused.value.body["message"] == (f"'best_of' is {shown}; jitserve's engine returns every choice it "
                                                 f"generates, so 'best_of' can only be 'n' ({n or 1}) or left out "
                                                 f"(vLLM V1 does not support best_of either)")


def test_parallel_tool_calls_without_tools_ask_for_nothing_and_tools_are_refused_by_name(served, client):
    """LangChain's function calling sends ``parallel_tool_calls`` beside ``tools``: without tools it asks for
    nothing and is taken (as vLLM takes it), with tools the refusal names ``tools``, whatever comes first."""
    for parallel in (True, False):
        answer = client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=2, temperature=0,
                                                parallel_tool_calls=parallel)
        assert answer.choices[0].finish_reason == "length"
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    status, body = served.post("/v1/chat/completions", {"parallel_tool_calls": False, "model": "llama3",
                                                        "messages": MESSAGES, "tools": [tool]})
    error = json.loads(body)["error"]
    assert status == 400 and (error["param"], error["code"]) == ("tools", "unsupported_parameter")
    assert error["message"].startswith("'tools' is not supported yet")
    for path, payload, message in [
            ("/v1/chat/completions", {"model": "llama3", "messages": MESSAGES, "parallel_tool_calls": "yes"},
             "'parallel_tool_calls' must be true or false, got \"yes\""),
            ("/v1/completions", {"model": "llama3", "prompt": PROMPT, "parallel_tool_calls": False},
             "unknown parameter 'parallel_tool_calls': /v1/completions takes ")]:
        status, body = served.post(path, payload)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "parallel_tool_calls" and error["message"].startswith(message)


def test_n_choices_are_seeded_one_apart_and_a_seed_repeats_them(client, folders):
    asked = {"model": "llama3", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    first = client.completions.create(n=3, **asked)
    texts = [choice.text for choice in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.text for c in client.completions.create(n=3, **asked).choices] == texts, "the same seed, the same texts"
    alone = [client.completions.create(**{**asked, "seed": 7 + i}) for i in range(3)]
    assert [answer.choices[0].text for answer in alone] == texts, "choice i is the request seeded seed + i"
    assert first.usage.completion_tokens == sum(answer.usage.completion_tokens for answer in alone)
    assert first.usage.prompt_tokens == alone[0].usage.prompt_tokens, "the prompt counted once"
    pieces: dict[int, str] = {}
    for chunk in client.completions.create(n=3, stream=True, **asked):  # the choices' pieces as they come
        pieces[chunk.choices[0].index] = pieces.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [pieces[i] for i in range(3)] == texts

    prompts = [PROMPT, "The quick brown fox"]
    several = client.completions.create(model="llama3", prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert [c.text for c in several.choices] == [js.generate("llama3", p, max_steps=4) for p in prompts for _ in "ab"]
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    assert several.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts), "each prompt once"


def test_n_samples_of_one_prompt_share_its_blocks_in_the_paged_cache(served, client, folders):
    prompt = checkpoints.CORPUS[1]  # a prompt no other test sends, of more than two blocks
    length = len(AutoTokenizer.from_pretrained(folders["llama3"])(prompt)["input_ids"])
    blocks = (length - 1) // 16
    assert blocks >= 2 and length + 4 <= 64
    server = served.servers["llama3"]
    before = server.stats()
    asked = {"model": "llama3", "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 11}
    answer = client.completions.create(n=4, **asked)
    after = server.stats()
    assert after.prefix_hits - before.prefix_hits >= 3 * blocks, "three samples took the first one's blocks"
    alone = [client.completions.create(**{**asked, "seed": 11 + i}).choices[0].text for i in range(4)]
    assert [choice.text for choice in answer.choices] == alone


def reference_logprobs(folder: Path, ids: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' log-softmax of the logits of each output after ``ids``: a row per output."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
    return torch.log_softmax(logits, dim=-1).numpy()


def test_completion_logprobs_are_transformers_log_softmax_streamed_or_not(client, folders):
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    answer = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    (choice,) = answer.choices
    text, scores = js.generate("llama3", PROMPT, max_steps=8, logprobs=3)
    tokens = [score.token for score in scores]
    assert choice.text == text and choice.logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    expected = reference_logprobs(folders["llama3"], tokenizer(PROMPT)["input_ids"], tokens)
    assert choice.logprobs.token_logprobs == pytest.approx([row[t] for row, t in zip(expected, tokens)], abs=2e-4)
    for top, row, token in zip(choice.logprobs.top_logprobs, expected, tokens):
        best = np.argsort(-row)[:3]
        assert top == pytest.approx({tokenizer.decode([t]): row[t] for t in [*best, token]}, abs=2e-4)
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(8)]
    chunks = [c.choices[0] for c in client.completions.create(model="llama3", prompt=PROMPT, max_tokens=8,
                                                              temperature=0, logprobs=3, stream=True)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == choice.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == choice.logprobs.text_offset
    assert [p for lp in streamed for p in lp.token_logprobs] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    only_chosen = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert [list(top) for top in only_chosen.choices[0].logprobs.top_logprobs] == \
        [[t] for t in only_chosen.choices[0].logprobs.tokens], "logprobs 0: the chosen token's alone"
    plain = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_give_each_token_its_bytes_and_top_logprobs(client, folders):
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    asked = {"model": "llama3", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    answer = client.chat.completions.create(top_logprobs=2, **asked)
    content = answer.choices[0].logprobs.content
    ids = chat_ids(folders["llama3"], MESSAGES)
    model = AutoModelForCausalLM.from_pretrained(folders["llama3"], dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    expected = reference_logprobs(folders["llama3"], ids, out)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in out]
    assert [c.logprob for c in content] == pytest.approx([row[t] for row, t in zip(expected, out)], abs=2e-4)
    for c, row in zip(content, expected):
        assert c.bytes == list(c.token.encode())
        assert [(t.token, t.bytes) for t in c.top_logprobs] == [(tokenizer.decode([t]), list(tokenizer.decode(
            [t]).encode())) for t in np.argsort(-row)[:2]]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(np.sort(row)[::-1][:2].tolist(), abs=2e-4)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True, top_logprobs=2, **asked)
                if c.choices[0].logprobs is not None]
    assert [c.token for lp in streamed for c in lp.content] == [c.token for c in content]
    assert client.chat.completions.create(**asked).choices[0].logprobs.content[0].top_logprobs == [], \
        "top_logprobs 0 by default"


def test_penalties_over_openai_are_the_in_process_ones(client):
    plain = [score.token for score in js.generate("llama3", PROMPT, max_steps=24, logprobs=0)[1]]
    for options in ({"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.6}):
        text, scores = js.generate("llama3", PROMPT, max_steps=24, logprobs=0, **options)
        assert [score.token for score in scores] != plain, f"{options} changed the tokens"
        openai_options = options if "repetition_penalty" not in options else {"extra_body": options}
        answer = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=24, temperature=0,
                                           **openai_options)
        assert answer.choices[0].text == text
    chat = client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=21, temperature=0,
                                          frequency_penalty=2.0, logprobs=True,
                                          extra_body={"repetition_penalty": 1.6})  # over the prompt's tokens too
    unpenalized = client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=21, temperature=0,
                                                 logprobs=True)
    assert [c.token for c in chat.choices[0].logprobs.content] != \
        [c.token for c in unpenalized.choices[0].logprobs.content]


def test_logit_bias_over_openai_equals_the_in_process_bias(client):
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys): banning the greedy answer's first token and
    favouring another gives the in-process answer with the same bias, chat and completion; what is not a
    bias is refused naming the field."""
    _, plain = js.generate("llama3", PROMPT, max_steps=6, logprobs=0)
    bias = {plain[0].token: -100, plain[1].token: 5}
    text, _ = js.generate("llama3", PROMPT, max_steps=6, logit_bias=bias, logprobs=0)
    asked = {"model": "llama3", "max_tokens": 6, "temperature": 0,
             "logit_bias": {str(token): value for token, value in bias.items()}}
    biased = client.completions.create(prompt=PROMPT, **asked)
    assert biased.choices[0].text == text != js.generate("llama3", PROMPT, max_steps=6)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **asked)
    assert chat.choices[0].finish_reason == "length", "a chat takes the field too"
    for value, message in [({"x": 1}, "'logit_bias' must map token ids (integers, as JSON writes them: \"50256\") "
                                      "to biases, got {'x': 1}"),
                           ({"5": 101}, "'logit_bias': logit_bias must map at most 300 token ids (integers >= 0) "
                                        "to numbers from -100 to 100, got {5: 101}"),
                           ({"99999": 1}, "logit_bias names token 99999, past the vocabulary of generation server "
                                          "'llama3'"),
                           ({"1" * 5000: 1}, "'logit_bias' names a token id of 5000 digits; a token id has at most "
                                             "10")]:  # past int()'s limit of 4,300 digits: read no further
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="llama3", prompt=PROMPT, max_tokens=2, logit_bias=value)
        assert message in refused.value.message


def test_min_tokens_over_openai_holds_the_end_back_as_in_process(client):
    """vLLM's ``min_tokens`` extension: so many outputs before the end token may be picked, in the engine."""
    seed = next(seed for seed in range(64)  # a sampled answer that ends early, at the end token
                if len(js.generate("llama3", PROMPT, max_steps=20, temperature=1.0, seed=seed, logprobs=0)[1]) < 20)
    asked = {"model": "llama3", "prompt": PROMPT, "max_tokens": 20, "seed": seed}
    early = client.completions.create(**asked)
    assert early.usage.completion_tokens < 20 and early.choices[0].finish_reason == "stop"
    held = client.completions.create(**asked, extra_body={"min_tokens": 20})
    text, _ = js.generate("llama3", PROMPT, max_steps=20, temperature=1.0, seed=seed, min_tokens=20, logprobs=0)
    assert held.choices[0].text == text and held.usage.completion_tokens == 20
    assert held.choices[0].finish_reason == "length"


def test_ignore_eos_over_openai_goes_past_the_end_token_as_in_process(client):
    """vLLM's ``ignore_eos`` (genai-perf's way to fixed output lengths): the end token is picked as without
    it, its text left out, and the choice goes on to ``max_tokens``; it ends for its length."""
    seed = next(seed for seed in range(64)
                if len(js.generate("llama3", PROMPT, max_steps=20, temperature=1.0, seed=seed, logprobs=0)[1]) < 20)
    asked = {"model": "llama3", "prompt": PROMPT, "max_tokens": 20, "seed": seed}
    early = client.completions.create(**asked, logprobs=0)
    ended = early.usage.completion_tokens
    assert ended < 20 and early.choices[0].finish_reason == "stop"
    going_on = client.completions.create(**asked, logprobs=0, extra_body={"ignore_eos": True})
    text, scores = js.generate("llama3", PROMPT, max_steps=20, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0)
    assert going_on.choices[0].text == text and going_on.usage.completion_tokens == len(scores) == 20
    assert going_on.choices[0].finish_reason == "length"
    assert going_on.choices[0].logprobs.tokens[:ended - 1] == early.choices[0].logprobs.tokens[:ended - 1], \
        "the same tokens up to the end token"
    assert scores[ended - 1].token == js.generate("llama3", PROMPT, max_steps=20, temperature=1.0, seed=seed,
                                                  logprobs=0)[1][-1].token, "the end token itself is picked"
    with pytest.raises(openai.BadRequestError, match="ignore_eos must be True or False, got 'yes'"):
        client.completions.create(**asked, extra_body={"ignore_eos": "yes"})


def test_vllms_top_k_of_minus_one_is_no_limit_min_p_and_stop_token_ids_end_the_text(client):
    """vLLM's extensions: ``top_k`` -1 samples from every token (the engine's 0), ``min_p`` cuts the unlikely
    ones, and ``stop_token_ids`` end a choice at the first of them, kept in its text, as in process."""
    asked = {"model": "llama3", "prompt": PROMPT, "max_tokens": 12, "seed": 11}
    sampled = client.completions.create(**asked).choices[0].text
    assert client.completions.create(**asked, extra_body={"top_k": -1}).choices[0].text == sampled
    assert client.completions.create(**asked, extra_body={"top_k": 0}).choices[0].text == sampled
    greedy = client.completions.create(**{**asked, "temperature": 0}).choices[0].text
    assert client.completions.create(**asked, temperature=1.5, extra_body={"min_p": 1}).choices[0].text == greedy, \
        "min_p 1 keeps the most likely token alone"
    with pytest.raises(openai.BadRequestError, match=r"'min_p': min_p must be a number in \[0, 1\]"):
        client.completions.create(**asked, extra_body={"min_p": 2})
    tokens = [score.token for score in js.generate("llama3", PROMPT, max_steps=12, logprobs=0)[1]]
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # its first time
    text, scores = js.generate("llama3", PROMPT, max_steps=12, stop_token_ids=[tokens[at]], logprobs=0)
    assert [score.token for score in scores] == tokens[:at + 1]
    answer = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"stop_token_ids": [tokens[at]]})
    assert answer.choices[0].text == text and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == at + 1
    with pytest.raises(openai.BadRequestError, match="'stop_token_ids': stop_token_ids must be a list of at most"):
        client.completions.create(model="llama3", prompt=PROMPT, extra_body={"stop_token_ids": [-3]})


def test_a_stop_sequence_ends_the_text_before_it(client):
    whole = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    answer = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=12, temperature=0,
                                       stop=[stop, "never appears"])
    assert answer.choices[0].text == whole[:whole.index(stop)] and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 12
    streamed = list(client.completions.create(model="llama3", prompt=PROMPT, max_tokens=12, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole[:whole.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_embeddings_equal_the_in_process_serving(served, client, folders):
    texts = ["a great film", "terrible, slow and boring"]
    expected = js.batched_run("embed", np.array(texts, dtype=object))["embedding"]
    answer = client.embeddings.create(model="embed", input=texts)  # the SDK asks for base64 and decodes it
    assert np.array_equal(np.array([d.embedding for d in answer.data], np.float32), expected)
    assert [d.index for d in answer.data] == [0, 1] and answer.model == "embed"
    tokenizer = AutoTokenizer.from_pretrained(folders["embed"])
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)
    as_floats = client.embeddings.create(model="embed", input=texts[0], encoding_format="float")
    alone = js.batched_run("embed", np.array(texts[:1], dtype=object))["embedding"]  # a batch of one, as here
    assert np.array_equal(np.array(as_floats.data[0].embedding, np.float32), alone[0])
    status, body = served.post("/v1/embeddings", {"model": "embed", "input": texts, "encoding_format": "base64"})
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in json.loads(body)["data"]]
    assert status == 200 and np.array_equal(np.stack(vectors), expected)


def test_tokenize_and_detokenize_answer_as_vllms_with_transformers_tokens(served, folders):
    """vLLM's ``POST /tokenize`` and ``/detokenize`` (LiteLLM's token counting reads them): a text's ids as
    ``transformers``' tokenizer gives them (special tokens added unless told not to), a chat's as its
    ``apply_chat_template``, each token's string as ``convert_ids_to_tokens``; ids back to text as its
    ``decode`` (special tokens kept)."""
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    status, body = served.post("/tokenize", {"model": "llama3", "prompt": PROMPT, "return_token_strs": True})
    ids = tokenizer(PROMPT)["input_ids"]
    assert status == 200 and json.loads(body) == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                                                  "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    bare = json.loads(served.post("/tokenize", {"model": "llama3", "prompt": PROMPT, "add_special_tokens": False})[1])
    assert bare["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"] != ids
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": PROMPT}]
    chat = json.loads(served.post("/tokenize", {"model": "chatml", "messages": messages})[1])
    assert chat["tokens"] == chat_ids(folders["chatml"], messages) and chat["max_model_len"] == 128
    status, body = served.post("/detokenize", {"model": "llama3", "tokens": ids})
    assert status == 200 and json.loads(body) == {"prompt": tokenizer.decode(ids)}
    null = json.loads(served.post("/tokenize", {"model": "llama3", "prompt": PROMPT, "messages": None})[1])
    assert null["tokens"] == ids, "null is absent, as elsewhere in the API"
    for path, payload, param, message in [
            ("/tokenize", {"model": "llama3", "prompt": PROMPT, "messages": messages}, "prompt",
             "send a 'prompt' (a text) or chat 'messages', one of them"),
            ("/tokenize", {"model": "llama3", "prompt": [1, 2]}, "prompt", "'prompt' must be a text, got [1,2]"),
            ("/tokenize", {"model": "plain", "messages": messages}, "messages", "model 'plain' has no chat template"),
            ("/tokenize", {"model": "llama3", "prompt": PROMPT, "chat_template": "x"}, "chat_template",
             "unknown parameter 'chat_template': /tokenize takes add_generation_prompt, add_special_tokens, "
             "messages, model, prompt, return_token_strs"),
            ("/detokenize", {"model": "llama3", "tokens": [1, 99999]}, "tokens",
             "'tokens' holds the token id 99999, outside the model's vocabulary"),
            ("/detokenize", {"model": "llama3", "tokens": "1 2"}, "tokens",
             "'tokens' must be a list of token ids (integers), got \"1 2\""),
            ("/tokenize", {"prompt": PROMPT}, "model",  # vLLM's model may be left out where it serves one
             "'model' must name one of the 3 text generations served: llama3, chatml, plain")]:
        status, body = served.post(path, payload)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == param and message in error["message"], (path, payload, error)
    status, body = served.post("/detokenize", {"model": "llama3", "tokens": ids}, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", "OpenAI's shape, its key"
    status, body = served.post("/tokenize", {"model": "mlp", "prompt": PROMPT})
    assert status == 404 and "is not served by the OpenAI API" in json.loads(body)["error"]["message"]


def test_tokenizer_info_answers_as_vllms_for_lm_evals_remote_tokenizer(served, folders):
    """vLLM's ``GET /tokenizer_info``, as lm-eval's ``tokenizer_backend=remote`` reads it where one text generation
    is served (then ``/tokenize`` and ``/detokenize`` take no model): the special tokens' text, the model's
    length and the chat template, each as ``transformers`` reads the checkpoint; where several are served, a 400
    naming them."""
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    port = free_port()
    with http_front(app.http_config(InferenceService({"llama3": served.servers["llama3"]}), "127.0.0.1", port)):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/tokenizer_info", timeout=30) as answer:
            info = json.loads(answer.read())
        assert info == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                        "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "model_max_length": 64,
                        "chat_template": tokenizer.chat_template} and info["chat_template"] == LLAMA3_TEMPLATE
        request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", json.dumps(
            {"prompt": PROMPT, "add_special_tokens": False}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read())["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for method, key, status, message in [
            ("GET", KEY, 400, "GET /tokenizer_info answers where one text generation is served (vLLM's takes no "
                              "model, as it serves one); this server serves 3: llama3, chatml, plain"),
            ("GET", None, 401, None), ("POST", KEY, 405, "POST is not allowed on /tokenizer_info; use GET")]:
        connection.request(method, "/tokenizer_info", headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]  # OpenAI's shape
        assert response.status == status and error["type"] == "invalid_request_error"
        assert message is None or (error["message"], error["param"]) == (message, "model" if status == 400 else None)
    connection.close()


def test_errors_come_in_openais_shape_naming_what_is_wrong(served, client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt=PROMPT)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert unknown.value.body == {"message": "unknown model 'nope'; this server has: llama3, chatml, plain, embed, mlp",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError, match="model 'mlp' is not served by the OpenAI API"):
        client.completions.create(model="mlp", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="model 'embed' is an embedding model, not a text generation"):
        client.completions.create(model="embed", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="model 'llama3' is a text generation, not an embedding model"):
        client.embeddings.create(model="llama3", input="x")
    for name, value in (("suffix", "!"), ("skip_special_tokens", False),
                        ("include_stop_str_in_output", True)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="llama3", prompt=PROMPT, max_tokens=2, extra_body={name: value})
        assert refused.value.param == name and refused.value.code == "unsupported_parameter"
        assert f"'{name}' is not supported yet" in refused.value.message
    neutral = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=2, temperature=0, presence_penalty=0,
                                        frequency_penalty=0.0, logprobs=None, best_of=1,
                                        extra_body={"skip_special_tokens": True, "spaces_between_special_tokens": True,
                                                    "include_stop_str_in_output": False})
    assert neutral.choices[0].finish_reason == "length", "the values that ask for nothing are accepted"
    for asked, message in [({"logprobs": 21}, "'logprobs' must be an integer from 0 to 20, got 21"),
                           ({"logprobs": -1}, "'logprobs' must be an integer from 0 to 20, got -1"),
                           ({"logprobs": 1, "echo": True}, "'echo' with 'logprobs' asks for the prompt's "
                                                           "log-probabilities, which jitserve does not compute"),
                           ({"presence_penalty": 2.5}, "'presence_penalty': presence_penalty must be a number from "
                                                       "-2 to 2 (0: none), got 2.5"),
                           ({"extra_body": {"repetition_penalty": 0}}, "'repetition_penalty': repetition_penalty "
                                                                       "must be a finite number > 0 (1: none), got 0"),
                           ({"extra_body": {"min_tokens": -1}}, "'min_tokens': min_tokens must be an integer in [0, "
                                                                "2147483648), got -1"),
                           ({"extra_body": {"min_tokens": 3}}, "'min_tokens' (3) must be at most 'max_tokens' (2)"),
                           ({"seed": 2**70}, "'seed' must be an integer from -2**63 to 2**64 - 1, got "
                                             "1180591620717411303424"),
                           ({"seed": 1.5}, "'seed' must be an integer, got 1.5"),
                           ({"seed": 5.0}, "'seed' must be an integer, got 5.0")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="llama3", prompt=PROMPT, max_tokens=2, **asked)
        assert message in refused.value.message
    for asked, message in [({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer from 0 to 20"),
                           ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=2, **asked)
        assert message in refused.value.message and refused.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match=r"unknown parameter 'beam_width': /v1/completions takes "):
        client.completions.create(model="llama3", prompt=PROMPT, extra_body={"beam_width": 2})
    for message, code in [({"role": "user"}, "missing_parameter"), ({"role": "system", "content": None},
                                                                      "missing_parameter"),
                          ({"role": "user", "content": 5}, "invalid_value")]:
        with pytest.raises(openai.BadRequestError) as refused:  # not rendered by the template as "None"
            client.chat.completions.create(model="llama3", messages=[message], max_tokens=2)
        assert (refused.value.param, refused.value.code) == ("messages[0].content", code)
        assert "messages[0].content must be a string or a list of text parts (null only in an assistant's " \
            f"message), got {json.dumps(message.get('content'))}" in refused.value.message
    with pytest.raises(openai.BadRequestError, match="model 'plain' has no chat template") as no_template:
        client.chat.completions.create(model="plain", messages=MESSAGES)
    assert no_template.value.code == "missing_chat_template"
    assert client.completions.create(model="plain", prompt=PROMPT, max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match=r"model 'llama3' generates at most 64 tokens per sequence \(its "
                                                     r"max_length\); the prompt has 12, which leaves room for 52: ask "
                                                     r"for at most 52 with 'max_tokens'"):
        client.completions.create(model="llama3", prompt=PROMPT, max_tokens=60)
    for create, asked, param in [  # OpenAI's code for a request past the context, naming what to shorten
            (client.completions.create, {"prompt": PROMPT, "max_tokens": 60}, "max_tokens"),
            (client.completions.create, {"prompt": PROMPT * 20}, "prompt"),
            (client.chat.completions.create, {"messages": MESSAGES, "max_completion_tokens": 60},
             "max_completion_tokens"),
            (client.chat.completions.create, {"messages": [{"role": "user", "content": PROMPT * 20}]}, "messages")]:
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="llama3", **asked)
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
        assert ("shorten it" in refused.value.message) == (param in ("prompt", "messages"))
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llama3", prompt=[PROMPT] * 129, max_tokens=1)
    assert refused.value.param == "prompt" and \
        "129 prompts make 129 generations; send at most 128 per request" in refused.value.message
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer from 1 to 128, got 0"):
        client.completions.create(model="llama3", prompt=PROMPT, n=0)
    with pytest.raises(openai.BadRequestError, match=r"'temperature': temperature must be a finite number >= 0"):
        client.completions.create(model="llama3", prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="'input' as token ids is not supported"):
        client.embeddings.create(model="embed", input=[[1, 2, 3]])
    for wrong in ([], {}, "", False):
        status, body = served.post("/v1/embeddings", {"model": "embed", "input": "x", "encoding_format": wrong})
        assert status == 400 and json.loads(body)["error"]["message"] == \
            f"'encoding_format' must be one of float, base64, got {json.dumps(wrong, separators=(',', ':'))}"
    status, body = served.post("/v1/completions", {"model": "llama3", "prompt": PROMPT, "stream_options": {}})
    assert status == 400 and json.loads(body)["error"]["param"] == "stream_options"
    status, body = served.post("/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["message"].startswith("the request body is not valid JSON")
    status, body = served.post("/v1/nothing", {})
    assert status == 404 and json.loads(body)["error"]["message"] == "no such endpoint: POST /v1/nothing"


def test_the_api_key_is_required_on_every_route_but_health(served):
    with pytest.raises(openai.AuthenticationError) as refused:
        served.client("sk-wrong").models.list()
    assert refused.value.code == "invalid_api_key" and refused.value.status_code == 401
    status, body = served.post("/v1/completions", {"model": "llama3", "prompt": PROMPT}, key=None)
    assert status == 401 and json.loads(body)["error"]["type"] == "invalid_request_error"
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    connection.request("GET", "/v2/models/llama3")
    assert connection.getresponse().status == 401, "the KServe routes take the same key"
    connection.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_choices_streamed_or_not(served, stream):
    """A client that gives up (the SDK's timeout, a closed socket) before the answer ends: its choices are
    cancelled, their slots freed, instead of generating every token for nobody."""
    server = served.servers["chatml"]
    before = server.stats()
    payload = json.dumps({"model": "chatml", "prompt": "x", "n": 64, "max_tokens": 100, "min_tokens": 100,
                          "stream": stream}).encode()
    connection = socket.create_connection(("127.0.0.1", served.port))
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (KEY.encode(), len(payload), payload))
    until(lambda: server.stats().requests == before.requests + 64, "the 64 choices to be submitted")
    connection.close()
    until(lambda: server.stats().slots_busy == server.stats().queue_depth == 0, "the choices to end")
    after = server.stats()
    assert after.completed - before.completed < 64 and after.cancelled > before.cancelled, \
        "cancelled when the client left, not run to their 100th token"
    answer = served.client().completions.create(model="chatml", prompt="x", max_tokens=2)
    assert answer.usage.completion_tokens == 2, "the server serves on"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v2/models/llama3/generate_stream"])
def test_a_stream_carries_the_cors_headers_and_request_id_as_a_whole_answer_does(served, path):
    """A browser page streaming a chat from an admitted origin reads the stream only with its CORS headers."""
    payload = {"model": "llama3", "messages": MESSAGES, "max_tokens": 2, "stream": True} if "v1" in path else \
        {"text_input": PROMPT, "max_tokens": 2}
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(payload).encode(),
                           {"Authorization": f"Bearer {KEY}", "Origin": ORIGIN, "X-Request-ID": "req-7"})
        response = connection.getresponse()
        assert response.status == 200 and response.read().endswith(b"\n\n")
    finally:
        connection.close()
    assert response.getheader("content-type") == "text/event-stream"
    assert (response.getheader("access-control-allow-origin"), response.getheader("x-request-id")) == (ORIGIN, "req-7")


def test_one_engine_answers_the_openai_kserve_and_in_process_callers(served, client):
    server = served.servers["llama3"]
    before = server.stats().requests
    in_process = js.generate("llama3", PROMPT, max_steps=5)
    status, body = served.post("/v2/models/llama3/generate", {"text_input": PROMPT, "max_tokens": 5})
    assert status == 200 and json.loads(body)["text_output"] == in_process
    assert client.completions.create(model="llama3", prompt=PROMPT, max_tokens=5,
                                     temperature=0).choices[0].text == in_process
    assert server.stats().requests == before + 3


def test_the_readme_openai_example_runs_against_jitserve_serve():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^jitserve serve (examples/llama\.py:generation --api-key \S+)", readme, re.M).group(1)
    example = next(code for code in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai import" in code)
    running = start_server(*command.split())
    try:
        done = subprocess.run([sys.executable, "-c", example.replace("localhost:8000", f"127.0.0.1:{running.port}")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("['llama']\n") and "completion_tokens=16" in done.stdout, done.stdout
    finally:
        output = stop(running)
    assert "Traceback" not in output
