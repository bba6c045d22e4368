"""No work whose size a client chooses runs on the HTTP front's event loop (issue 56): while a long prompt is
tokenized (or its chat rendered), ``/health`` and every other request are still answered, on each door that
takes text (OpenAI's completions, chat, ``/tokenize`` and embeddings, Triton's generate extension, KServe
``infer`` of a generation and of an encoder).

The tokenizer of the served checkpoint is held inside its work by the test (an event it waits on), so that
the check is on states, not times: ``/health`` must answer while the long request is still held. On a front
that tokenized on its loop, the held tokenizer would hold the loop, and ``/health`` would not answer until
it is let go. A prompt longer than the context could hold (``PROMPT_CHARS_PER_TOKEN`` characters per token)
is refused before any tokenizing, on each door; chat templates render within their bounds."""

from __future__ import annotations

import http.client
import json
import sys
import threading
from pathlib import Path

import pytest

import jitserve as js
from jitserve.models.pretrained import text_hook
from jitserve.protocol import app
from jitserve.protocol.llm import PROMPT_CHARS_PER_TOKEN
from jitserve.protocol.service import InferenceService
from netutil import free_port, http_front

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the checkpoints the model tests make
import checkpoints

MAX_LENGTH = 128
MARK = "held "  # a text that starts so (a chat's: its first line) is held inside the tokenizer until the test lets it go
LONG = MARK + "word " * 600  # 3,005 characters: tokenized off the loop, refused after (past the context)
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
DOORS = {
    "completions": ("/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 4}),
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": LONG}]}),
    "tokenize": ("/tokenize", {"model": "m", "prompt": LONG}),
    "generate": ("/v2/models/m/generate", {"text_input": LONG, "max_tokens": 4}),
    "infer": ("/v2/models/m/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                                 "data": [LONG]}]}),
    "embeddings": ("/v1/embeddings", {"model": "embed", "input": [LONG]}),
    "embedding infer": ("/v2/models/embed/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                                               "data": [LONG]}]}),
}
GENERATION_DOORS = ["completions", "chat", "tokenize", "generate", "infer"]


class Held:
    """The tokenizer's ``encode_many`` wrapped: a text that starts with ``MARK`` waits for ``release``."""

    def __init__(self, tokenizer) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.wrap(tokenizer, self)

    @staticmethod
    def wrap(tokenizer, held) -> None:
        original = tokenizer.encode_many

        def encode_many(texts, special=True):
            if any(MARK in (text.decode() if isinstance(text, bytes) else str(text))[:64] for text in texts):
                held.entered.set()
                assert held.release.wait(120), "the test never let the tokenizer go"
            return original(texts, special)

        tokenizer.encode_many = encode_many


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = checkpoints.llama(tmp_path_factory.mktemp("off-loop") / "llama", heads=4, kv_heads=4, tied=True, seed=2)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    generation = js.from_pretrained(folder, slots=2, max_length=MAX_LENGTH)
    embedding = js.from_pretrained(checkpoints.bert(folder.parent / "bert", "embedding"), task="embedding",
                                   max_length=32, batch_size=2)
    hook = text_hook(generation)
    held = Held(hook.tokenizer)
    Held.wrap(text_hook(embedding).tokenizer, held)
    servers = {"m": js.serve(generation, name="m"), "embed": js.serve(embedding, name="embed")}
    port = free_port()
    with http_front(app.http_config(InferenceService(servers), "127.0.0.1", port)):
        yield port, held, hook
        held.release.set()
    for server in servers.values():
        server.stop()


def request(port, method, path, payload=None, timeout=60):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, None if payload is None else json.dumps(payload).encode())
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("door", DOORS)
def test_health_answers_while_a_long_prompt_is_tokenized(front, door):
    port, held, _ = front
    held.entered.clear()
    held.release.clear()
    path, payload = DOORS[door]
    answers = []
    sender = threading.Thread(target=lambda: answers.append(request(port, "POST", path, payload)))
    sender.start()
    try:
        assert held.entered.wait(60), f"the {door} request reached the tokenizer"
        status, _ = request(port, "GET", "/health", timeout=30)  # the loop is free: answered while it is held
        assert status == 200
        assert not answers, "the long request is still held in its tokenizer"
    finally:
        held.release.set()
        sender.join(60)
    status, body = answers[0]
    assert status == (200 if door == "tokenize" else 400), body  # past the context: refused once tokenized
    if status == 400:
        assert (b"128" if door in GENERATION_DOORS else b"at most 32") in body, body  # names the model's length


@pytest.mark.parametrize("door", GENERATION_DOORS)
def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized(front, door):
    port, held, _ = front
    held.entered.clear()
    path, payload = DOORS[door]
    longest = MAX_LENGTH * PROMPT_CHARS_PER_TOKEN
    huge = json.loads(json.dumps(payload).replace(json.dumps(LONG), json.dumps(MARK + "x" * longest)))
    status, body = request(port, "POST", path, huge)
    assert status == 400
    assert f"{longest:,}".encode() in body, body  # the bound, named
    assert not held.entered.is_set(), "nothing was tokenized"


def test_a_chat_template_past_its_bounds_is_a_400_naming_the_template(tmp_path):
    from jitserve.errors import ModelError
    from jitserve.models.checkpoint import Checkpoint
    from jitserve.models.tokenizer import Tokenizer

    folder = checkpoints.llama(tmp_path / "llama", heads=4, kv_heads=4, tied=True, seed=2)
    tokenizer = Tokenizer(Checkpoint(str(folder)))
    messages = [{"role": "user", "content": "hi"}]
    refusals = {
        "{{ 'x' * 10**10 }}": "repeats a sequence of 1 1e+10 times",
        "{{ 'x' | center(10**10) }}": "calls 'center' with 1e+10",
        "{{ 'x'.ljust(10**10) }}": "calls 'ljust' with 1e+10",
        "{{ ('x' * 1000) | replace('x', 'y' * 10000) }}": "replaces text into 1e+07 characters",
        "{{ '{:>10000000000}'.format('x') }}": "formats text 1e+10 wide",
        "{{ '%*s' % (10000000000, 'x') }}": "calls '%' with 1e+10",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}":
            "joins text past its bound",
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}":
            "ran past its bound of 1 s of CPU time",
        "{% for a in range(100000) %}{{ 'y' * 100 }}{% endfor %}": "rendered more than its bound",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "failed on these messages: RecursionError",
        "{{ 1 / 0 }}": "failed on these messages: ZeroDivisionError",
    }
    for template, message in refusals.items():
        tokenizer.chat_template = template
        with pytest.raises(ModelError, match="^the chat template ") as info:
            tokenizer.render_chat(messages)
        assert message in str(info.value) and info.value.status == 400, template
    tokenizer.chat_template = TEMPLATE
    assert tokenizer.render_chat(messages) == "user: hi\nassistant:"


def test_token_ids_are_checked_against_the_model_s_embedding_not_its_tokenizer(front, monkeypatch):
    """A padded embedding (more rows than the tokenizer has ids: here the tokenizer is made to say it has 20
    fewer) reads every id below its rows; an id past them is refused, named with the model's vocabulary
    (issue 56, item 6)."""
    port, _, hook = front
    fewer = hook.vocabulary - 20
    monkeypatch.setattr(type(hook.tokenizer), "vocabulary", property(lambda self: fewer))
    last = hook.vocabulary - 1
    status, body = request(port, "POST", "/v1/completions", {"model": "m", "prompt": [1, last], "max_tokens": 2,
                                                             "temperature": 0})
    assert status == 200, body
    for path, field in (("/v1/completions", "prompt"), ("/detokenize", "tokens")):
        status, body = request(port, "POST", path, {"model": "m", field: [1, last + 1]})
        assert status == 400
        assert f"holds the token id {last + 1}, outside the model's vocabulary (0 to {last})".encode() in body, body
