"""A js.Generation behind the real `jitserve serve`: HTTP infer and server-sent events, gRPC ModelInfer and
ModelStreamInfer through tritonclient, per-request sampling as request parameters, bad input as 400 /
INVALID_ARGUMENT, and its metrics. Loopback only."""

from __future__ import annotations

import json
import queue
import socket
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from generation_models import expected, expected_text  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import start_server, stop  # noqa: E402
from waiting import until  # noqa: E402

MODELS = str(Path(__file__).with_name("generation_models.py")) + ":models"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def server():
    running = start_server(MODELS)
    yield running
    output = stop(running)
    assert "Traceback" not in output
    assert "INFO jitserve.generation: generation server gen: compiled the prefill of 1 prompt of 8 tokens in " \
        in output, "warm-up logs each program it compiles, naming the model, as a Serving's does"


def body(prompt=PROMPT, datatype="INT32", **parameters) -> bytes:
    shape = list(np.shape(prompt))
    return json.dumps({"id": "q", "inputs": [{"name": "prompt", "datatype": datatype, "shape": shape,
                                              "data": np.ravel(prompt).tolist()}],
                       "parameters": parameters}).encode()


def events(server, model: str, payload: bytes) -> list[dict]:
    status, headers, data = server.request("POST", f"/v2/models/{model}/infer_stream", payload)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), data
    return [json.loads(line[len(b"data: "):]) for line in data.split(b"\n\n") if line.startswith(b"data: ")]


def test_http_infer_answers_every_output_and_sse_one_event_per_step(server):
    status, answer = server.infer_json("gen", body(max_steps=6))
    assert status == 200
    assert answer["outputs"] == [{"name": "output", "datatype": "INT32", "shape": [6], "data": expected(PROMPT, 6)}]
    steps = events(server, "gen", body(max_steps=5))
    assert [event["outputs"][0]["data"] for event in steps] == [[token] for token in expected(PROMPT, 5)]
    assert all(event["id"] == "q" and event["outputs"][0]["shape"] == [1] for event in steps)
    default = server.infer_json("gen", body())[1]["outputs"][0]
    assert default["shape"] == [16], "max_steps defaults to 16 (vLLM's)"


def test_text_in_and_text_out_through_preprocess_and_postprocess(server):
    """A BYTES prompt goes to the generation's preprocess (a tokenizer), each output through its postprocess
    (the token's text): over HTTP JSON, server-sent events and tritonclient's gRPC stream."""
    status, answer = server.infer_json("text", body(["héllo"], "BYTES", max_steps=6))
    assert status == 200
    output = answer["outputs"][0]
    assert output["datatype"] == "BYTES" and output["shape"] == [6]
    assert "".join(output["data"]).encode() == expected_text("héllo", 6)
    steps = events(server, "text", body(["héllo"], "BYTES", max_steps=4))
    assert [event["outputs"][0]["data"][0].encode() for event in steps] == \
        [bytes([byte]) for byte in expected_text("héllo", 4)]
    metadata = json.loads(server.request("GET", "/v2/models/text")[2])
    assert metadata["inputs"][0]["datatype"] == metadata["outputs"][0]["datatype"] == "BYTES"
    config = json.loads(server.request("GET", "/v2/models/text/config")[2])
    assert config["input"][0]["data_type"] == config["output"][0]["data_type"] == "TYPE_STRING"
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    prompt = grpcclient.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array(["héllo".encode()], dtype=object))
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("text", [prompt], parameters={"max_steps": 5})
        pieces = []
        for _ in range(5):
            result, error = results.get(timeout=30)
            assert error is None, error
            pieces.append(result.as_numpy("output")[0])
    finally:
        client.stop_stream()
    assert b"".join(pieces) == expected_text("héllo", 5)
    text = expected_text("héllo", 30)
    stop = text[7:9].decode()
    cut = text[:text.index(stop.encode())]
    answer = server.infer_json("text", body(["héllo"], "BYTES", max_steps=30, stop=stop))[1]
    assert "".join(answer["outputs"][0]["data"]).encode() == cut, "the text up to the stop sequence, left out"
    steps = events(server, "text", body(["héllo"], "BYTES", max_steps=30, stop=stop))
    assert "".join(event["outputs"][0]["data"][0] for event in steps).encode() == cut
    answer = server.infer_json("text", body(["héllo"], "BYTES", max_steps=30, stop=text[:1].decode()))[1]
    assert answer["outputs"][0]["shape"] == [0], "stopped before any text"
    status, answer = server.infer_json("gen", body(max_steps=3, stop="x"))
    assert status == 400 and answer["error"] == ("the 'stop' parameter: stop needs a generation whose postprocess "
                                                 "gives text; this one gives its outputs as they are")
    status, answer = server.infer_json("text", body([1, 2], "INT32"))
    assert status == 400 and answer["error"] == "a text prompt is one string; got ndarray"
    status, answer = server.infer_json("text", body(["x" * 17], "BYTES"))
    assert status == 400 and "the prompt has 17 tokens, more than the longest prefill length (16" in answer["error"]


def test_sampling_parameters_are_per_request_and_seeded(server):
    first = server.infer_json("gen", body(max_steps=12, temperature=2.0, top_p=0.9, seed=5))[1]
    again = server.infer_json("gen", body(max_steps=12, temperature=2.0, top_p=0.9, seed=5))[1]
    other = server.infer_json("gen", body(max_steps=12, temperature=2.0, top_p=0.9, seed=6))[1]
    tokens = first["outputs"][0]["data"]
    assert tokens == again["outputs"][0]["data"] and tokens != other["outputs"][0]["data"]
    assert tokens != expected(PROMPT, 12)


def test_tritonclient_grpc_streams_a_generation_with_parameters(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        prompt = grpcclient.InferInput("prompt", [1, 3], "INT64")
        prompt.set_data_from_numpy(np.array([PROMPT], np.int64))
        client.async_stream_infer("gen", [prompt], request_id="g1", parameters={"max_steps": 5},
                                  enable_empty_final_response=True)
        received = [results.get(timeout=30) for _ in range(6)]
        assert all(error is None for _, error in received)
        assert [r.as_numpy("output").tolist() for r, _ in received[:5]] == [[t] for t in expected(PROMPT, 5)]
        assert [r.get_response().parameters["triton_final_response"].bool_param for r, _ in received] == \
            [False] * 5 + [True]
        client.async_stream_infer("gen", [prompt], request_id="g2",
                                  parameters={"max_steps": 5, "temperature": 1.0, "seed": 3})
        sampled = [results.get(timeout=30)[0].as_numpy("output").item() for _ in range(5)]
        client.async_stream_infer("gen", [prompt], request_id="g3",
                                  parameters={"max_steps": 5, "temperature": 1.0, "seed": 3})
        assert [results.get(timeout=30)[0].as_numpy("output").item() for _ in range(5)] == sampled
        client.async_stream_infer("gen", [prompt], request_id="g4", parameters={"max_steps": 0})
        result, error = results.get(timeout=30)
        assert result is None and "request 'g4': the 'max_steps' parameter must be a positive integer, got 0" \
            in str(error)
    finally:
        client.stop_stream()
    answer = client.infer("gen", [prompt], parameters={"max_steps": 4})
    assert answer.as_numpy("output").tolist() == expected(PROMPT, 4)


@pytest.mark.parametrize("payload, message", [
    (body([]), "the prompt is empty; send at least one token"),
    (body(list(range(1, 18))), "the prompt has 17 tokens, more than the longest prefill length (16; max_length "
                               "is 64)"),
    (body([1.0, 2.0], "FP32"), "input 'prompt' has datatype FP32, but model 'gen' expects INT32 or INT64 token ids"),
    (body([[1, 2], [3, 4]]), "input 'prompt' has shape [2, 2]; model 'gen' takes one prompt per request, shaped "
                             "[n] or [1, n]"),
    (body(max_steps="8"), "the 'max_steps' parameter must be a positive integer, got '8'"),
    (body(temperature=-1), "a sampling parameter: temperature must be a finite number >= 0 (0: greedy), got -1"),
    (body(top_p=2), r"a sampling parameter: top_p must be a number in (0, 1], got 2"),
    (body(priority=1), "model 'gen' is a generation: it admits prompts in arrival order and has no priority levels"),
    (body(logit_bias='{"' + "1" * 5000 + '": 1}'),  # past int()'s limit of 4,300 digits (as gRPC's text too)
     "the 'logit_bias' parameter names a token id of 5000 digits; a token id has at most 10"),
])
def test_bad_generation_requests_are_400_over_http_and_invalid_argument_over_grpc(server, payload, message):
    status, answer = server.infer_json("gen", payload)
    assert status == 400 and message in answer["error"], answer
    status, _, data = server.request("POST", "/v2/models/gen/infer_stream", payload)
    assert status == 400 and message in json.loads(data)["error"]
    request = json.loads(payload)
    tensor = request["inputs"][0]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    prompt = grpcclient.InferInput("prompt", tensor["shape"], tensor["datatype"])
    prompt.set_data_from_numpy(np.array(tensor["data"], {"INT32": np.int32, "FP32": np.float32}[tensor["datatype"]])
                               .reshape(tensor["shape"]))
    parameters = {k: v for k, v in request["parameters"].items() if k != "priority"}
    with pytest.raises(InferenceServerException) as failure:
        client.infer("gen", [prompt], parameters=parameters, priority=request["parameters"].get("priority", 0))
    assert failure.value.status() == "StatusCode.INVALID_ARGUMENT" and message in failure.value.message()


def test_a_client_that_leaves_frees_its_slot_and_metrics_show_the_generation(server):
    connection = socket.create_connection(("127.0.0.1", server.port))
    payload = body(max_steps=400)
    connection.sendall(b"POST /v2/models/slow/infer_stream HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(payload), payload))
    received = b""
    while b"data: " not in received:  # the headers, then the first step's event
        received += connection.recv(65536)
    assert gauge(server, "jitserve_generation_slots_busy", "slow") == 1
    connection.close()
    until(lambda: gauge(server, "jitserve_generation_slots_busy", "slow") == 0, "the slot to be free at the next step")
    assert gauge(server, "jitserve_generation_slots", "slow") == 2
    assert gauge(server, "jitserve_generation_first_output_seconds_count", "slow") >= 1
    assert gauge(server, "jitserve_generation_step_seconds_count", "slow") >= 1
    status, _, data = server.request("GET", "/v2/models/slow/stats")
    stats = json.loads(data)["model_stats"][0]
    assert status == 200 and stats["execution_count"] >= 1, "its decode launches ran"
    assert stats["inference_count"] == stats["inference_stats"]["queue"]["count"] == 0, \
        "as Triton counts: only requests that completed, and the client left this one"
    status, _, data = server.request("GET", "/v2/models/gen/config")
    assert json.loads(data)["model_transaction_policy"] == {"decoupled": True}


@pytest.mark.parametrize("endpoint", ["generate", "infer"])
def test_a_client_that_leaves_before_a_whole_generate_answer_frees_its_slot(server, endpoint):
    """Not streamed (Triton's generate extension, or KServe's infer): the answer comes at the last step, but a
    client that gave up (an SDK's timeout) before it cancels the generation instead of holding its slot to the
    last token for nobody."""
    steps = gauge(server, "jitserve_generation_step_seconds_count", "slow")
    connection = socket.create_connection(("127.0.0.1", server.port))
    payload = json.dumps({"prompt": PROMPT, "max_steps": 500} if endpoint == "generate" else
                         {"inputs": [{"name": "prompt", "datatype": "INT32", "shape": [len(PROMPT)], "data": PROMPT}],
                          "parameters": {"max_steps": 500}}).encode()
    connection.sendall(b"POST /v2/models/slow/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                       % (endpoint.encode(), len(payload), payload))
    until(lambda: gauge(server, "jitserve_generation_slots_busy", "slow") == 1, "the generation to take a slot")
    connection.close()
    until(lambda: gauge(server, "jitserve_generation_slots_busy", "slow") == 0, "the slot to be free at the next step")
    assert gauge(server, "jitserve_generation_step_seconds_count", "slow") - steps < 250, \
        "cancelled when the client left, not run to its 500th output"


def test_a_grpc_infer_cancelled_by_its_client_frees_its_slot(server):
    """KServe's unary ModelInfer on a generation answers at the last step; a tritonclient that cancels the
    call (``CallContext.cancel``, as a deadline does) cancels the generation too (grpc.aio cancels the
    handler), freeing its slot at the next step."""
    steps = gauge(server, "jitserve_generation_step_seconds_count", "slow")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    prompt = grpcclient.InferInput("prompt", [3], "INT32")
    prompt.set_data_from_numpy(np.array(PROMPT, np.int32))
    answers = []
    call = client.async_infer("slow", [prompt], lambda result, error: answers.append(error),
                              parameters={"max_steps": 500})
    until(lambda: gauge(server, "jitserve_generation_slots_busy", "slow") == 1, "the generation to take a slot")
    call.cancel()
    until(lambda: gauge(server, "jitserve_generation_slots_busy", "slow") == 0, "the slot to be free at the next step")
    assert gauge(server, "jitserve_generation_step_seconds_count", "slow") - steps < 250, \
        "cancelled with its call, not run to its 500th output"
    until(lambda: answers, "the cancelled call to end")
    assert "CANCELLED" in str(answers[0])
    client.close()


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_the_generate_extension_refuses_a_stream_flag_that_is_no_flag_as_such(server, endpoint):
    for flag, message in [("yes", "'stream' must be true or false, got \"yes\""),
                          (endpoint == "generate", f"'stream': {json.dumps(endpoint == 'generate')} does not match "
                                                   f"the endpoint; POST to generate{'_stream' * (endpoint == 'generate')}"
                                                   f" instead")]:
        status, _, data = server.request("POST", f"/v2/models/gen/{endpoint}",
                                         json.dumps({"prompt": PROMPT, "max_steps": 2, "stream": flag}).encode())
        assert status == 400 and json.loads(data)["error"] == message


def gauge(server, metric: str, model: str) -> float:
    text = server.request("GET", "/metrics")[2].decode()
    for line in text.splitlines():
        if line.startswith(f'{metric}{{model="{model}",version="1"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {metric} for {model} in /metrics")
