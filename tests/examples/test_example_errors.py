"""The examples behind the real `jitserve serve`: what a client gets wrong in a request (a number where a text
goes, several prompts, bytes that are not UTF-8, a text too long, no text) is a 400 / INVALID_ARGUMENT saying
what was wrong, from the examples' own preprocess (``js.ModelError``), never a 500; the server logs no
failure of its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import serving  # noqa: E402

TARGET = str(Path(__file__).with_name("served_examples.py")) + ":models"


@pytest.fixture(scope="module")
def server():
    with serving(TARGET) as running:
        yield running
    assert "ERROR" not in running.output(), "no request failed inside the server"


def tensor(name, datatype, data, shape=None):
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape or [len(data)], "data": data}]}


JSON_MISTAKES = [
    ("bert", tensor("text", "FP32", [1.5]), "text 0 is float; expected a string (str, or UTF-8 bytes)"),
    ("bert", tensor("text", "INT64", [7]), "text 0 is int; expected a string"),
    ("bert", tensor("text", "BYTES", [], [0]), "send at least one text"),
    ("bert", tensor("text", "BYTES", ["word " * 300]), "tokens long; this model reads at most 128"),
    ("bert", tensor("sentence", "BYTES", ["a fine film"]), "unknown input 'sentence' for model 'bert'; expected: text"),
    ("embed", tensor("text", "FP32", [1.5]), "text 0 is float; expected a string"),
    ("llama", tensor("text_input", "FP32", [1.5]), "a prompt is one text (str, or UTF-8 bytes; over the network a "
                                                   "BYTES tensor of one element); got float32 values shaped [1]"),
    ("llama", tensor("text_input", "BYTES", ["one", "two"]), "a prompt is one text (str, or UTF-8 bytes; over the "
                                                             "network a BYTES tensor of one element); got 2 texts"),
    ("llama", tensor("text_input", "BYTES", ["word " * 100]), "tokens, more than max_length (32)"),
    ("llama", tensor("text_input", "BYTES", ["word " * 300]), "input 'text_input' is 1,500 bytes long; model 'llama' "
                                                             "takes at most 1,024 (32 per token of its max_length)"),
    ("mlp", tensor("input", "FP32", [0.5] * 15, [1, 15]), "input 'input' has shape [1, 15], but model 'mlp' expects "
                                                         "[-1, 16]"),
]


@pytest.mark.parametrize(("model", "payload", "message"), JSON_MISTAKES)
def test_a_mistaken_request_to_an_example_is_a_400_saying_what_was_wrong(server, model, payload, message):
    status, answer = server.infer_json(model, payload)
    assert (status, message in answer["error"]) == (400, True), answer


@pytest.mark.parametrize("model", ["bert", "embed", "llama"])
def test_text_that_is_not_utf8_is_a_400_over_binary_data_and_grpc(server, model):
    name = "text_input" if model == "llama" else "text"
    for module, port in ((httpclient, server.port), (grpcclient, server.grpc_port)):
        text = module.InferInput(name, [1], "BYTES")
        text.set_data_from_numpy(np.array([b"\xff\xfe not UTF-8"], dtype=object))
        with pytest.raises(InferenceServerException) as refused:
            module.InferenceServerClient(f"127.0.0.1:{port}").infer(model, [text])
        assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), refused.value
        assert "text 0 is not UTF-8" in refused.value.message()


def test_the_generate_endpoint_and_the_openai_api_answer_400_too(server):
    status, _, body = server.request("POST", "/v2/models/llama/generate", json.dumps({"text_input": 5}).encode())
    assert status == 400 and "BYTES data must be strings, got 5" in json.loads(body)["error"]
    status, _, body = server.request("POST", "/v1/completions", json.dumps(
        {"model": "llama", "prompt": "word " * 300, "max_tokens": 4}).encode())
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", body
    status, _, body = server.request("POST", "/v1/embeddings", json.dumps({"model": "embed", "input": [3]}).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "input", body
