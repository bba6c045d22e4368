"""The real `jitserve serve` CLI on loopback ports, driven by tritonclient and raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gevent
import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("uvicorn")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import network_models  # noqa: E402
from gates import gate_env, holding, started  # noqa: E402
from network_models import example  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import Running, free_port, start_server, stop  # noqa: E402
from waiting import until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MAX_BODY = 200_000
MODELS = str(ROOT / "tests/protocol/network_models.py") + ":models"


def start(*extra: str, gate: Path | None = None) -> Running:
    """A server of the network models (gated in the folder ``gate``, when given)."""
    return start_server(MODELS, "--max-body-bytes", str(MAX_BODY), *extra, env=None if gate is None else gate_env(gate))


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    """The folder of the gates on the module's servers' batches (``gates.py``)."""
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def server(gate):
    running = start("--request-timeout", "0.3", gate=gate)
    yield running
    output = stop(running)
    assert "SIGTERM: shutting down" in output
    assert "127.0.0.1" in output and "0.0.0.0" not in output
    assert "compiled batch size 32" in output, "warm-up compiles are logged"
    assert "WARNING jitserve.serve: http: model 'mlp': 400: input 'input' has datatype FP64" in output
    assert "ERROR jitserve.serve: grpc: model 'fragile' failed (request id " in output
    assert "ValueError: negative input" in output, "the model's failure is in the log, under its request id"
    assert "was killed by SIGSEGV" in output
    assert "model 'forged\\nERROR fake line'" in output and "\nERROR fake line" not in output, "log lines cannot be forged"
    assert "leaked" not in output, "the IREE model's runtime objects are freed before the interpreter exits"


@pytest.fixture(scope="module")
def patient(gate):
    """A server of the same models without a request timeout: what a test holds waits as long as it holds it."""
    running = start(gate=gate)
    yield running
    stop(running)


def reference_mlp(x: np.ndarray) -> np.ndarray:
    hidden = np.maximum(x @ example.W1, 0.0)
    logits = hidden @ example.W2
    return np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)


# tritonclient, http and grpc ------------------------------------------------------------------

@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritonclient_health_metadata_and_infer(server, client_module):
    port = server.port if client_module is httpclient else server.grpc_port
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    metadata = client.get_server_metadata()
    metadata = metadata if isinstance(metadata, dict) else {"name": metadata.name, "extensions": list(metadata.extensions)}
    assert metadata["name"] == "jitserve" and "binary_tensor_data" in metadata["extensions"]
    model = client.get_model_metadata("mlp")
    if not isinstance(model, dict):
        model = {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in model.inputs],
                 "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in model.outputs]}
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]
    x = np.random.default_rng(1).normal(size=(5, 16)).astype(np.float32)
    for binary in ([True, False] if client_module is httpclient else [True]):
        tensor = client_module.InferInput("input", [5, 16], "FP32")
        tensor.set_data_from_numpy(x, **({"binary_data": binary} if client_module is httpclient else {}))
        outputs = [client_module.InferRequestedOutput("output", **(
            {"binary_data": binary} if client_module is httpclient else {}))]
        result = client.infer("mlp", [tensor], outputs=outputs)
        np.testing.assert_allclose(result.as_numpy("output"), reference_mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritonclient_dict_inputs_and_outputs(server, client_module):
    port = server.port if client_module is httpclient else server.grpc_port
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    scale = np.array([2.0, 3.0], np.float32)
    inputs = [client_module.InferInput("x", [2, 4], "FP32"), client_module.InferInput("scale", [2], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(scale)
    result = client.infer("affine", inputs)
    np.testing.assert_allclose(result.as_numpy("y"), x * scale[:, None] + 1)
    np.testing.assert_allclose(result.as_numpy("norm"), np.linalg.norm(x, axis=-1), rtol=1e-6)


TEXTS = np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)


@pytest.mark.parametrize(("client_module", "binary"), [(httpclient, True), (httpclient, False), (grpcclient, True)],
                         ids=["http-binary", "http-json", "grpc"])
def test_text_in_and_out_through_the_servings_preprocess_and_postprocess(server, client_module, binary):
    """BYTES tensors reach ``preprocess`` as the request sent them; its (batch, info) reaches ``postprocess``
    with the batch reports, as in process; BYTES outputs come back."""
    port = server.port if client_module is httpclient else server.grpc_port
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = client_module.InferInput("text", [3], "BYTES")
    names = ("text", "doubled", "batches")
    if client_module is httpclient:
        tensor.set_data_from_numpy(TEXTS, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in names]
    else:
        tensor.set_data_from_numpy(TEXTS)
        outputs = [grpcclient.InferRequestedOutput(name) for name in names]
    result = client.infer("text", [tensor], outputs=outputs)
    texts = [t if isinstance(t, bytes) else t.encode() for t in result.as_numpy("text").tolist()]  # JSON: str
    assert texts == [b"HELLO!", "W\u00f6RLD!".encode(), b"!"]
    assert result.as_numpy("doubled").tolist() == [[10.0], [12.0], [0.0]]
    assert result.as_numpy("batches").tolist() == [1, 1, 1]
    assert network_models.text_serving.run(list(TEXTS))["text"].tolist() == texts, "over the network as in process"


def test_bytes_over_json_and_its_errors(server):
    status, body = server.infer_json("text", {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2, 1],
                                                          "data": [["ab"], ["\u00e9"]]}]})
    assert status == 200, body
    assert {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["AB!", "\u00e9!"]} in body["outputs"]
    status, body = server.infer_json("mlp", {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1],
                                                         "data": ["x"]}]})
    assert status == 400 and body["error"] == "input 'input' has datatype BYTES, but model 'mlp' expects FP32"
    status, body = server.infer_json("text", {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2],
                                                          "data": ["ab", 3]}]})
    assert status == 400 and body["error"] == "input 't': BYTES data must be strings, got 3"
    blob = (2).to_bytes(4, "little") + b"ab" + (9).to_bytes(4, "little") + b"c"
    header = json.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": len(blob)}}]}).encode()
    status, headers, data = server.request("POST", "/v2/models/text/infer", header + blob,
                                           headers={"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and json.loads(data)["error"] == "input 't': BYTES element 1 says 9 bytes, but 1 are left"
    metadata = json.loads(server.request("GET", "/v2/models/text")[2])
    assert metadata["inputs"] == [] and metadata["outputs"] == [], "a preprocess decides what it takes"
    server.assert_healthy()


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritonclient_model_config_statistics_and_repository_index(server, client_module):
    grpc_side = client_module is grpcclient
    client = client_module.InferenceServerClient(f"127.0.0.1:{server.grpc_port if grpc_side else server.port}")
    as_json = {"as_json": True} if grpc_side else {}
    config = client.get_model_config("mlp", **as_json)
    config = config["config"] if grpc_side else config
    number = str if grpc_side else int  # protobuf's JSON mapping writes 64-bit integers as strings
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [number(16)]}]
    assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": [number(4)]}]
    assert config["dynamic_batching"] == {"preferred_batch_size": [1, 2, 4, 8, 16, 32],
                                          "max_queue_delay_microseconds": number(2000)}

    before = client.get_inference_statistics("affine", **as_json)["model_stats"][0]
    x = np.ones((3, 4), np.float32)
    inputs = [client_module.InferInput("x", [3, 4], "FP32"), client_module.InferInput("scale", [3], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(np.ones(3, np.float32))
    client.infer("affine", inputs)
    after = client.get_inference_statistics("affine", **as_json)["model_stats"][0]
    assert (after["name"], after["version"]) == ("affine", "1")
    success = after["inference_stats"]["success"]
    assert int(success["count"]) == int(before["inference_stats"]["success"].get("count", 0)) + 1
    assert int(success["ns"]) > 0 and int(after["inference_count"]) == int(before.get("inference_count", 0)) + 3
    assert any(int(entry["batch_size"]) == 4 for entry in after["batch_stats"]), "3 rows run padded to 4"

    def count(duration):  # protobuf's JSON leaves a zero out
        return int(duration.get("count", 0))

    # Triton's counts: per request (queue and the three compute phases alike, as perf_analyzer checks), per
    # execution by batch size
    stats = after["inference_stats"]
    assert count(stats["queue"]) == count(before["inference_stats"]["queue"]) + 1
    assert count(stats["queue"]) == count(stats["compute_input"]) == count(stats["compute_infer"]) == \
        count(stats["compute_output"])
    assert count(stats["cache_hit"]) == count(stats["cache_miss"]) == 0, "no response cache"
    assert int(after["execution_count"]) == sum(count(entry["compute_infer"]) for entry in after["batch_stats"])
    assert all(count(entry["compute_input"]) == count(entry["compute_infer"]) == count(entry["compute_output"])
               for entry in after["batch_stats"])
    every = client.get_inference_statistics(**as_json)["model_stats"]
    assert {entry["name"] for entry in every} >= {"mlp", "affine", "versioned"}

    index = client.get_model_repository_index(**as_json)
    index = index["models"] if grpc_side else index
    assert {(entry["name"], entry["version"], entry["state"]) for entry in index} >= {
        ("mlp", "1", "READY"), ("versioned", "1", "READY"), ("versioned", "2", "READY")}


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_model_versions_are_served_and_unknown_ones_are_404(server, client_module):
    grpc_side = client_module is grpcclient
    client = client_module.InferenceServerClient(f"127.0.0.1:{server.grpc_port if grpc_side else server.port}")
    tensor = client_module.InferInput("input", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[10.0]], np.float32))
    assert client.infer("versioned", [tensor], model_version="1").as_numpy("output").tolist() == [[11.0]]
    assert client.infer("versioned", [tensor], model_version="2").as_numpy("output").tolist() == [[12.0]]
    latest = client.infer("versioned", [tensor])
    assert latest.as_numpy("output").tolist() == [[12.0]], "no version: the highest"
    for result, version in ((client.infer("versioned", [tensor], model_version="1"), "1"), (latest, "2")):
        response = result.get_response()
        assert (response.model_version if grpc_side else response["model_version"]) == version, \
            "the response names the version that ran"
    metadata = client.get_model_metadata("versioned", **({"as_json": True} if grpc_side else {}))
    assert metadata["versions"] == ["1", "2"]
    assert client.is_model_ready("versioned", "1") and client.is_model_ready("mlp", "1")
    for call in (lambda: client.infer("mlp", [tensor], model_version="999"),
                 lambda: client.get_model_metadata("mlp", "999"), lambda: client.get_model_config("mlp", "999")):
        with pytest.raises(InferenceServerException) as unknown:
            call()
        assert "model 'mlp' has no version '999'; it has: 1" in unknown.value.message()
        assert unknown.value.status() in ("404", "StatusCode.NOT_FOUND")
    assert server.request("GET", "/v2/models/mlp/versions/999/ready")[0] == 404


def test_grpc_health_says_not_serving_until_a_starting_server_is_ready():
    """A server still starting its HTTP front processes (``--http-workers``) is not ready, over gRPC health too,
    until they all listen (``opened``)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from jitserve.protocol.grpc import GrpcServer
    from jitserve.protocol.limits import Limits
    from jitserve.protocol.service import InferenceService

    service = InferenceService({})
    service.opening = True
    assert not service.ready() and service.unready_reason == "starting"
    server = GrpcServer(service, "127.0.0.1", free_port(), Limits())
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "inference.GRPCInferenceService"):
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
            service.opening = False
            server.opened()
            assert service.ready()
            for name in ("", "inference.GRPCInferenceService"):
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30).status == \
                    health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_grpc_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "inference.GRPCInferenceService"):  # what grpc_health_probe asks
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(reflection.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")])))
    assert {s.name for s in replies[0].list_services_response.service} == {
        "inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert replies[1].file_descriptor_response.file_descriptor_proto, "reflection describes the service"
    channel.close()


def test_grpc_errors_carry_status_and_message(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("input", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [tensor])
    assert "INVALID_ARGUMENT" in str(info.value.status())
    assert "input 'input' has shape [1, 3], but model 'mlp' expects [-1, 16]" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [tensor])
    assert "NOT_FOUND" in str(info.value.status()) and "unknown model 'nope'" in info.value.message()
    server.assert_healthy()


# bad input over raw HTTP ---------------------------------------------------------------------

def mlp_input(**overrides):
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}
    tensor.update(overrides)
    return {"inputs": [tensor]}


BAD_REQUESTS = [
    (b"{not json", 400, "the request body is not valid JSON"),
    (b"[1, 2]", 400, "the request must be a JSON object with an 'inputs' list"),
    ({"inputs": []}, 400, "the request needs a non-empty 'inputs' list"),
    (mlp_input(datatype="FP64"), 400, "input 'input' has datatype FP64, but model 'mlp' expects FP32"),
    (mlp_input(datatype="BYTES"), 400, "input 'input': BYTES data must be strings, got 0.5"),
    (mlp_input(datatype="FLOAT"), 400, "input 'input': unknown datatype 'FLOAT'"),
    (mlp_input(shape=[1, 15], data=[0.5] * 15), 400, "input 'input' has shape [1, 15], but model 'mlp' expects [-1, 16]"),
    (mlp_input(shape=[2, 16]), 400, "input 'input': 16 values, expected 32 for shape [2, 16]"),
    (mlp_input(shape=[0, 16], data=[]), 400, "the inputs hold no rows (batch size 0)"),
    (mlp_input(shape="1x16"), 400, "input 'input': shape must be a list of non-negative integers"),
    (mlp_input(data=["a"] * 16), 400, "input 'input': 'a' is not a number (strings allowed in float data"),
    (mlp_input(name="inputs"), 400, "unknown input 'inputs' for model 'mlp'; expected: input"),
    (mlp_input(data=None) | {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16]}]}, 400,
     "input 'input' has no 'data', binary_data_size or shared_memory_region parameter"),
    ({**mlp_input(), "outputs": [{"name": "logits"}]}, 400, "unknown output 'logits' for model 'mlp'; it has: output"),
    ({**mlp_input(), "outputs": 5}, 400, "'outputs' must be a list of objects with a string 'name'"),
    (mlp_input(shape=[0] * 70, data=[]), 400, "input 'input': shape has 70 dimensions; at most 32 are supported"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "the request body is not valid JSON: DEPTH_ERROR: The JSON document was too deep"),
    (mlp_input(shape=[0, 2**63 - 1], data=[]), 400, "input 'input': shape [0, 9223372036854775807] has a dimension over"),
    (mlp_input(shape=[2**63, 0], data=[]), 400, "has a dimension over 2147483647"),
    (mlp_input(data=[1, True, 2.5, False] * 4), 400, "input 'input': data must be FP32 values (true/false only for BOOL)"),
    (mlp_input(data=[0.5] * 15 + [1e39]), 400, "input 'input': 1e+39 does not fit FP32, whose largest finite value is "
                                               "3.40282e+38 (an infinity is sent as \"Infinity\" or \"-Infinity\")"),
    (mlp_input(shape=[64, 16], data=[0.5] * 1000 + [-1e60] + [0.5] * 23), 400,  # simdjson reads this one
     "input 'input': -1e+60 does not fit FP32"),
    ({**mlp_input(), "parameters": "x"}, 400, "the request: 'parameters' must be a JSON object, got str"),
    (mlp_input(parameters=[1]), 400, "input 'input': 'parameters' must be a JSON object, got list"),
    ({**mlp_input(), "outputs": [{"name": "output", "parameters": 3}]}, 400,
     "output 'output': 'parameters' must be a JSON object, got int"),
    ({**mlp_input(), "parameters": {"binary_data_output": "false"}}, 400,
     "the request: parameter 'binary_data_output' must be true or false, got 'false'"),
    ({**mlp_input(), "outputs": [{"name": "output", "parameters": {"binary_data": 1}}]}, 400,
     "output 'output': parameter 'binary_data' must be true or false, got 1"),
]


@pytest.mark.parametrize(("payload", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, payload, status, message):
    got, body = server.infer_json("mlp", payload)
    assert got == status
    assert message in body["error"]
    server.assert_healthy()


def test_jitserve_serve_runs_xla_cpu_computations_inline_on_its_partitions(server):
    status, body = server.infer_json("dispatch", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1],
                                                              "data": [5.0]}]})
    assert status == 200 and body["outputs"][0]["data"] == [0.0], "jax_cpu_enable_async_dispatch is off"


def test_binary_bodies_are_checked_to_the_last_byte(server):
    x = np.ones((1, 16), np.float32)
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    for extra, message in [(b"junk", "the body has 4 bytes after the last binary input"), (b"", None)]:
        status, _, body = server.request("POST", "/v2/models/mlp/infer", header + x.tobytes() + extra,
                                         {"Inference-Header-Content-Length": str(len(header))})
        if message is None:
            assert status == 200
        else:
            assert status == 400 and message in json.loads(body)["error"]
    both = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16,
                                   "parameters": {"binary_data_size": 64}}]}).encode()
    status, _, body = server.request("POST", "/v2/models/mlp/infer", both + x.tobytes(),
                                     {"Inference-Header-Content-Length": str(len(both))})
    assert status == 400 and "has both 'data' and a binary_data_size parameter; send one" in json.loads(body)["error"]
    server.assert_healthy()


def model_infer(server: Running, model: str) -> tuple[grpc.Channel, Any, Any]:
    """A channel to the server's gRPC port, its ModelInfer call on messages, and an empty request for ``model``."""
    from jitserve.protocol.grpc import MESSAGES

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                response_deserializer=MESSAGES["ModelInferResponse"].FromString)
    return channel, infer, MESSAGES["ModelInferRequest"](model_name=model)


def test_grpc_refuses_raw_and_typed_contents_together(server):
    channel, infer, request = model_infer(server, "mlp")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    tensor.contents.fp32_contents.extend([0.0] * 16)
    request.raw_input_contents.append(np.zeros(16, np.float32).tobytes())
    with pytest.raises(grpc.RpcError) as info:
        infer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both raw_input_contents and typed contents" in info.value.details()
    channel.close()


def test_grpc_says_which_typed_contents_field_a_datatype_needs(server):
    channel, infer, request = model_infer(server, "mlp")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    tensor.contents.int_contents.extend([1] * 16)
    with pytest.raises(grpc.RpcError) as info:
        infer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "input 'input': FP32 values go in contents.fp32_contents, but the request filled " \
                                   "int_contents"
    tensor.contents.ClearField("int_contents")
    tensor.contents.fp32_contents.extend([0.5] * 16)
    assert list(infer(request).outputs[0].shape) == [1, 4]
    channel.close()


def test_64_bit_inputs_are_refused_where_the_model_computes_in_32_bits(server):
    model = json.loads(server.request("GET", "/v2/models/wide")[2])
    assert model["inputs"][0]["datatype"] == "INT32", "without x64 the metadata says what the model computes in"
    status, body = server.infer_json("wide", {"inputs": [{"name": "input", "datatype": "INT64", "shape": [1, 3],
                                                          "data": [1, 2**32 + 1, 2**62]}]})
    assert status == 400 and body["error"] == ("input 'input' has datatype INT64, but model 'wide' expects INT32 (it "
                                               "computes without 64-bit types: run the server with JAX_ENABLE_X64=1 "
                                               "for them)")
    status, body = server.infer_json("wide", {"inputs": [{"name": "input", "datatype": "INT32", "shape": [1, 3],
                                                          "data": [1, 2, 3]}]})
    assert status == 200 and body["outputs"][0]["data"] == [2, 3, 4]


def test_a_request_larger_than_the_queue_can_ever_hold_is_a_4xx(server):
    status, body = server.infer_json("slow", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 1],
                                                          "data": [1.0, 2.0]}]})
    assert status == 400 and body["error"] == "a request of 2 rows can never fit server 'slow''s queue: max_queue is 1 rows"


def test_non_finite_floats_are_strict_json_both_ways(server):
    status, _, data = server.request("POST", "/v2/models/reciprocal/infer", json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 2], "data": [0.0, -0.0, "Infinity", "NaN"]}]}
    ).encode())
    assert status == 200 and b"NaN" in data
    body = json.loads(data, parse_constant=lambda token: pytest.fail(f"bare {token} in a JSON response"))
    assert body["outputs"][0]["data"] == ["Infinity", "-Infinity", 0.0, "NaN"]
    status, body = server.infer_json("reciprocal", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],
                                                                "data": [1.0, "one"]}]})
    assert status == 400 and "'one' is not a number (strings allowed in float data: NaN, Infinity, -Infinity)" \
        in body["error"]


def test_a_body_cut_short_by_a_half_close_never_runs(server):
    def batches_run() -> float:
        found = re.search(r'jitserve_batch_size_count\{model="chunked",version="1"\} (\S+)',
                          server.request("GET", "/metrics")[2].decode())
        return float(found.group(1)) if found else 0.0

    before = batches_run()
    body = json.dumps(column([1.0, 2.0])).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v2/models/chunked/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                 + str(len(body) + 100).encode() + b"\r\n\r\n" + body)  # 100 bytes short
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()
    time.sleep(0.3)
    assert batches_run() == before, "a request whose body never fully arrived did not run"
    server.assert_healthy()


def test_the_server_may_open_as_many_files_as_the_system_allows(server):
    limits = Path(f"/proc/{server.process.pid}/limits")
    if not limits.exists():
        pytest.skip("no /proc here")
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits.read_text()).groups()
    assert soft == hard, "the soft limit on open files was raised to the hard one"


def test_client_text_cannot_forge_log_lines(server):
    status, _, _ = server.request("POST", "/v2/models/forged%0AERROR%20fake%20line/infer",
                                  json.dumps(mlp_input()).encode())  # the model name holds a newline
    assert status == 404


def test_a_huge_unknown_model_name_is_cut_in_the_error_and_stays_not_found(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("m" * 20_000, [tensor])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message().startswith("unknown model '" + "m" * 100 + "...'; this server has: ")
    assert len(info.value.message()) < 400
    server.assert_healthy()


def test_unknown_model_and_endpoint(server):
    status, body = server.infer_json("nope", mlp_input())
    assert status == 404 and body["error"] == "unknown model 'nope'; this server has: mlp, affine, ints, fragile, slow, lookup, crashing, ordered, chunked, steps, wide, versioned, reciprocal, dispatch, text"
    status, _, data = server.request("GET", "/v2/models/nope")
    assert status == 404 and "unknown model 'nope'" in json.loads(data)["error"]
    status, _, data = server.request("GET", "/v3/anything")
    assert status == 404 and json.loads(data)["error"] == "no such endpoint: GET /v3/anything"
    status, _, data = server.request("GET", "/v2/models/mlp/infer")
    assert status == 405
    server.assert_healthy()


def test_body_over_the_limit_is_413(server):
    big = mlp_input(data=[0.5] * 16)
    big["padding"] = "x" * (MAX_BODY + 10)
    status, body = server.infer_json("mlp", big)
    assert status == 413 and f"exceeds the limit of {MAX_BODY} bytes" in body["error"]
    status, _, data = server.request("POST", "/v2/repository/index", b"{}" + b" " * MAX_BODY)
    assert status == 413 and f"exceeds the limit of {MAX_BODY} bytes" in json.loads(data)["error"]
    server.assert_healthy()


def test_binary_extension_errors(server):
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    status, _, data = server.request("POST", "/v2/models/mlp/infer", header + b"\0" * 10,
                                     {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "binary_data_size 64 does not fit the 10 binary bytes left" in json.loads(data)["error"]
    status, _, data = server.request("POST", "/v2/models/mlp/infer", header, {"Inference-Header-Content-Length": "999"})
    assert status == 400 and "Inference-Header-Content-Length is 999" in json.loads(data)["error"]
    server.assert_healthy()


def test_integer_inputs_are_checked_for_range(server):
    status, body = server.infer_json("ints", {"inputs": [{"name": "input", "datatype": "INT32", "shape": [1, 3],
                                                          "data": [1, 2, 3]}]})
    assert status == 200 and body["outputs"][0]["data"] == [2, 4, 6]
    status, body = server.infer_json("ints", {"inputs": [{"name": "input", "datatype": "INT32", "shape": [1, 3],
                                                          "data": [1, 2, 2**40]}]})
    assert status == 400 and "data does not fit INT32" in body["error"]
    status, body = server.infer_json("ints", {"inputs": [{"name": "input", "datatype": "INT32", "shape": [1, 3],
                                                          "data": [1.5, 2, 3]}]})
    assert status == 400 and "data must be INT32 values" in body["error"]


def test_a_failing_model_is_500_for_its_request_only(server):
    def request(values):
        return server.infer_json("fragile", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],
                                                         "data": values}]})

    status, body = request([-1.0, 1.0])
    assert status == 500 and re.fullmatch(r"internal error in model 'fragile'; the server log has the details under "
                                          r"request id [0-9a-f]{16}", body["error"]), "no model internals leak"
    status, body = request([1.0, 2.0])
    assert status == 200 and body["outputs"][0]["data"] == [1.0, 2.0]
    assert "internal error in model 'fragile'; the server log has the details under request id" in \
        grpc_internal_error(server, "fragile", [[-1.0, 0.0]])
    server.assert_healthy()


def grpc_internal_error(server: Running, model: str, rows: list) -> str:
    """Infer over gRPC where the model fails: the status must be INTERNAL; returns the message."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("input", [len(rows), len(rows[0])], "FP32")
    tensor.set_data_from_numpy(np.array(rows, np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [tensor])
    assert "INTERNAL" in str(info.value.status())
    return info.value.message()


def test_iree_out_of_range_indices_are_clamped_as_xla_does_and_the_server_keeps_serving(server):
    import jax
    from network_models import TABLE, lookup

    def request(ids):
        return server.infer_json("lookup", {"inputs": [{"name": "input", "datatype": "INT32", "shape": [len(ids), 3],
                                                        "data": [v for row in ids for v in row]}]})

    bad = [[0, 12, -30], [2**30, -(2**31), 9]]  # out of range: XLA clamps (never another buffer's memory)
    status, body = request(bad)
    assert status == 200, body
    want = np.asarray(jax.jit(lookup)(np.array(bad, np.int32)))
    assert body["outputs"][0]["data"] == want.ravel().tolist()
    good = [[1, 2, 3]]
    status, body = request(good)
    assert status == 200 and body["outputs"][0]["data"] == TABLE[good].ravel().tolist()
    server.assert_healthy()


def test_a_native_crash_in_a_worker_process_fails_only_its_batch(server):
    def request(values):
        return server.infer_json("crashing", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],
                                                          "data": values}]})

    status, body = request([-1.0, 1.0])  # segfaults the worker process
    assert status == 500 and "internal error in model 'crashing'" in body["error"], body
    status, body = request([1.0, 2.0])  # a new worker answers
    assert status == 200 and body["outputs"][0]["data"] == [2.0, 4.0]
    assert "internal error in model 'crashing'" in grpc_internal_error(server, "crashing", [[-3.0, 0.0]])
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("input", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[3.0, 0.5]], np.float32))
    assert client.infer("crashing", [tensor]).as_numpy("output").tolist() == [[6.0, 1.0]]
    server.assert_healthy()


# streaming and priorities ------------------------------------------------------------------------

def sse_events(response) -> list[tuple[str, dict]]:
    """Parse a server-sent events body: (event name, JSON data) per event."""
    events = []
    for block in response.read().decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def column(values: list[float]) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [len(values), 1], "data": values}]}


def stream_successes(server, model: str) -> int:
    _, _, data = server.request("GET", f"/v2/models/{model}/stats")
    return json.loads(data)["model_stats"][0]["inference_stats"]["success"]["count"]


def test_http_server_sent_events_bring_each_batch_as_it_finishes(server):
    before = stream_successes(server, "chunked")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v2/models/chunked/infer_stream", body=json.dumps(column([0, 1, 2, 3, 4])).encode())
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("content-type") == "text/event-stream"
    events = sse_events(response)
    assert [name for name, _ in events] == ["message"] * 3, "5 rows, batch size 2: three events, first rows first"
    assert [e["outputs"][0]["data"] for _, e in events] == [[0.0, 2.0], [4.0, 6.0], [8.0]]
    assert stream_successes(server, "chunked") == before + 1, "a streamed request counts in the statistics"
    connection.request("POST", "/v2/models/steps/infer_stream", body=json.dumps(column([10])).encode())
    events = sse_events(connection.getresponse())
    assert [e["outputs"][0]["data"] for _, e in events] == [[10.0], [11.0], [12.0]], "one event per step"
    connection.close()
    status, body = server.infer_json("steps", column([1]))
    assert status == 400 and "streams its results: call it with ModelStreamInfer" in body["error"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v2/models/nope/infer_stream", body=json.dumps(column([1])).encode())
    assert connection.getresponse().status == 404, "errors before the stream starts are ordinary statuses"
    connection.close()


def test_a_client_that_leaves_mid_stream_frees_its_queued_rows(server):
    def batches_run() -> float:
        metrics = server.request("GET", "/metrics")[2].decode()
        found = re.search(r'jitserve_batch_size_count\{model="chunked",version="1"\} (\S+)', metrics)
        return float(found.group(1)) if found else 0.0

    before = batches_run()
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps(column([float(v) for v in range(20)])).encode()  # 10 batches of 0.1 s
    sock.sendall(b"POST /v2/models/chunked/infer_stream HTTP/1.1\r\nHost: x\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert b"data: " in sock.recv(65536) or b"data: " in sock.recv(65536)  # the first event arrived
    sock.close()
    until(lambda: server.queued_rows("chunked") == 0, "the queue to empty")  # run, or taken off
    assert batches_run() - before < 10, "the rows of a client that went away were taken off the queue"
    server.assert_healthy()


def test_tritonclient_grpc_streaming_works_unchanged(server):
    import queue

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        tensor = grpcclient.InferInput("input", [3, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0], [2.0], [3.0]], np.float32))
        client.async_stream_infer("chunked", [tensor], request_id="a", enable_empty_final_response=True)
        received = [results.get(timeout=30) for _ in range(3)]
        assert all(error is None for _, error in received)
        assert [r.as_numpy("output").ravel().tolist() for r, _ in received[:2]] == [[2.0, 4.0], [6.0]]
        assert [r.get_response().parameters["triton_final_response"].bool_param for r, _ in received] == \
            [False, False, True], "Triton's decoupled protocol: each response says whether it is the last"
        step = grpcclient.InferInput("input", [1, 1], "FP32")
        step.set_data_from_numpy(np.array([[5.0]], np.float32))
        client.async_stream_infer("steps", [step], request_id="b")
        assert [results.get(timeout=30)[0].as_numpy("output").item() for _ in range(3)] == [5.0, 6.0, 7.0]
        client.async_stream_infer("nope", [step], request_id="c")
        result, error = results.get(timeout=30)
        assert result is None and "unknown model 'nope'" in str(error)
    finally:
        client.stop_stream()
    server.assert_healthy()


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritonclient_priority_runs_urgent_requests_first(patient, gate, client_module):
    server = patient
    port = server.port if client_module is httpclient else server.grpc_port
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}", **(
        {"concurrency": 4} if client_module is httpclient else {}))

    def send(value: float, priority: int):
        tensor = client_module.InferInput("input", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[value]], np.float32))
        if client_module is httpclient:
            return client.async_infer("ordered", [tensor], priority=priority)
        outcome: queue.Queue = queue.Queue()
        client.async_infer("ordered", [tensor], callback=lambda result, error: outcome.put((result, error)),
                           priority=priority)
        return outcome

    def order_of(handle) -> float:
        if client_module is httpclient:
            return float(handle.get_result().as_numpy("output")[0, 1])
        result, error = handle.get(timeout=30)
        assert error is None, error
        return float(result.as_numpy("output")[0, 1])

    import queue

    def sent(condition):
        """``condition`` checked while tritonclient.http's greenlets, which send its requests, run."""
        return (lambda: gevent.sleep(0.001) or condition()) if client_module is httpclient else condition

    with holding(gate, "ordered"):
        before = started(gate, "ordered")
        busy = send(0.0, 1)
        until(sent(lambda: started(gate, "ordered") > before), "the first request to run")  # the one partition
        low = send(1.0, 2)
        until(sent(lambda: server.queued_rows("ordered") == 1), "the level-2 request to be queued")
        urgent = send(2.0, 1)
        until(sent(lambda: server.queued_rows("ordered") == 2), "the level-1 request to be queued")
    orders = [order_of(handle) for handle in (busy, low, urgent)]
    assert orders[0] < orders[2] < orders[1], "the level-1 request, queued last, ran before the level-2 one"


def test_queue_full_is_503_and_timeout_is_504(server, gate):
    def call(results, key):
        results[key] = server.infer_json("slow", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1],
                                                              "data": [1.0]}]})

    for _ in range(20):  # a try that the machine's slowness spoiled (see below) is tried again
        results: dict[str, tuple[int, dict]] = {}
        running = threading.Thread(target=call, args=(results, "running"))
        late = [threading.Thread(target=call, args=(results, key)) for key in ("late 1", "late 2")]
        with holding(gate, "slow"):
            before = started(gate, "slow")
            running.start()
            until(lambda: started(gate, "slow") > before, "the first request to run")
            for caller in late:  # one is queued (max_queue 1) and times out, the other finds the queue full
                caller.start()
            for caller in late:
                caller.join(30)
        running.join(30)
        answers = sorted((results[key] for key in ("late 1", "late 2")), key=lambda answer: answer[0])
        if results["running"][0] != 504 and [status for status, _ in answers] != [504, 504]:
            break  # else the partition took the first one over 0.3 s late, or the second late one came too late
    assert results["running"][0] == 200 and results["running"][1]["outputs"][0]["data"] == [2.0]
    assert [status for status, _ in answers] == [503, 504], answers
    assert "queue is full" in answers[0][1]["error"]
    assert "timed out after 0.3s before its rows started" in answers[1][1]["error"]
    server.assert_healthy()


def test_concurrent_load_every_result_checked(server):
    failures, done = [], []

    def caller(seed):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        rng = np.random.default_rng(seed)
        for _ in range(20):
            rows = int(rng.integers(1, 40))
            x = rng.normal(size=(rows, 16)).astype(np.float32)
            tensor = httpclient.InferInput("input", [rows, 16], "FP32")
            tensor.set_data_from_numpy(x)
            out = client.infer("mlp", [tensor]).as_numpy("output")
            if not np.allclose(out, reference_mlp(x), rtol=1e-5, atol=1e-6):
                failures.append(seed)
        done.append(seed)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and sorted(done) == list(range(8))


def test_metrics(server):
    server.infer_json("mlp", mlp_input())
    status, headers, data = server.request("GET", "/metrics")
    text = data.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'jitserve_requests_total{model="mlp",protocol="http",status="200",version="1"}' in text  # sorted
    assert 'jitserve_batch_size_bucket{le="1.0",model="mlp",version="1"}' in text
    assert 'jitserve_queue_depth{model="mlp",version="1"} 0.0' in text
    assert 'jitserve_compiles{model="mlp",version="1"} 6.0' in text
    assert "jitserve_padding_rows_total" in text and "jitserve_execution_seconds_bucket" in text
    count = re.search(r'jitserve_request_seconds_count\{model="mlp",version="1"\} (\S+)', text)
    assert count is not None and float(count.group(1)) >= 1, "request durations by model and version"
    for process in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                    "python_gc_collections_total"):
        assert process in text, process
    families = {family.name: family for family in text_string_to_metric_families(text)}
    ours = [family for name, family in families.items() if name.startswith("jitserve_")]
    assert {"jitserve_requests", "jitserve_request_seconds", "jitserve_queue_wait_seconds", "jitserve_batch_size",
            "jitserve_queue_depth", "jitserve_compiles"} <= {family.name for family in ours}
    for family in ours:  # one label scheme: every sample of every family names its model and version
        for sample in family.samples:
            assert {"model", "version"} <= set(sample.labels), (family.name, sample.labels)
    waits = families["jitserve_queue_wait_seconds"].samples
    assert any(s.name.endswith("_count") and s.labels["model"] == "mlp" and s.value >= 1 for s in waits)


# fuzz ----------------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=12)
tensors = st.fixed_dictionaries(
    {"name": st.sampled_from(["input", "x", "scale", ""]),
     "datatype": st.sampled_from(["FP32", "FP64", "INT32", "BOOL", "BYTES", "UINT8", "??"]),
     "shape": st.one_of(st.lists(st.integers(-2, 20), max_size=3), st.lists(st.just(0), min_size=30, max_size=80),
                        json_values)},
    optional={"data": st.one_of(st.lists(st.floats(width=32) | st.integers(-5, 5), max_size=40), json_values),
              "parameters": st.one_of(st.fixed_dictionaries({"binary_data_size": st.integers(-4, 100)}), json_values)})
bodies = st.one_of(
    st.fixed_dictionaries({"inputs": st.one_of(st.lists(tensors, max_size=3), json_values)},
                          optional={"outputs": st.one_of(st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}),
                                                                  max_size=2), json_values),
                                    "parameters": json_values, "id": json_values}),
    json_values)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, model=st.sampled_from(["mlp", "affine", "ints", "missing"]))
def test_fuzz_infer_never_5xx_never_hangs(server, body, model):
    status, _, data = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(), timeout=10)
    assert status < 500, data
    if status != 200:
        assert "error" in json.loads(data)


binary_inputs = st.lists(st.fixed_dictionaries(
    {"name": st.sampled_from(["input", "x", "scale"]),
     "datatype": st.sampled_from(["FP32", "INT32", "BOOL", "FP64", "BYTES"]),
     "shape": st.lists(st.integers(-1, 17), max_size=3) | st.lists(st.sampled_from([0, 2**62, 2**63 - 1]), max_size=3),
     "blob": st.binary(max_size=80), "declared": st.none() | st.integers(-3, 100)}), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=binary_inputs, trailing=st.binary(max_size=8), header_length=st.none() | st.integers(-5, 400),
       model=st.sampled_from(["mlp", "affine", "ints"]))
def test_fuzz_binary_bodies_never_5xx_never_hang(server, inputs, trailing, header_length, model):
    header = json.dumps({"inputs": [
        {"name": i["name"], "datatype": i["datatype"], "shape": i["shape"],
         "parameters": {"binary_data_size": len(i["blob"]) if i["declared"] is None else i["declared"]}}
        for i in inputs]}).encode()
    body = header + b"".join(i["blob"] for i in inputs) + trailing
    status, _, data = server.request("POST", f"/v2/models/{model}/infer", body, timeout=10, headers={
        "Inference-Header-Content-Length": str(len(header) if header_length is None else header_length)})
    assert status < 500, data
    assert status == 200 or "error" in json.loads(data)


GRPC_ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
grpc_tensors = st.lists(st.fixed_dictionaries(
    {"name": st.sampled_from(["input", "x", ""]),
     "datatype": st.sampled_from(["FP32", "INT32", "BOOL", "INT64", "BYTES", "??"]),
     "shape": st.lists(st.integers(-2, 17) | st.sampled_from([2**62, 2**63 - 1]), max_size=3),
     "fp32": st.lists(st.floats(width=32), max_size=20), "ints": st.lists(st.integers(-2**31, 2**31 - 1), max_size=20),
     "raw": st.none() | st.binary(max_size=80)}), max_size=3)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=grpc_tensors, model=st.sampled_from(["mlp", "ints", "missing", ""]), garbage=st.none() | st.binary(
    min_size=1, max_size=40), priority=st.none() | st.integers(0, 2**64 - 1))
def test_fuzz_grpc_messages_never_internal_never_hang(server, tensors, model, garbage, priority):
    from jitserve.protocol.grpc import MESSAGES

    request = MESSAGES["ModelInferRequest"](model_name=model)
    for tensor in tensors:
        entry = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if tensor["raw"] is not None:
            request.raw_input_contents.append(tensor["raw"])
        else:
            entry.contents.fp32_contents.extend(tensor["fp32"])
            entry.contents.int_contents.extend(tensor["ints"])
    if priority is not None:
        request.parameters["priority"].uint64_param = priority
    data = garbage if garbage is not None else request.SerializeToString()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    try:
        infer(data, timeout=10)
    except grpc.RpcError as error:
        assert error.code() in GRPC_ANSWERS, (error.code(), error.details())
        assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED or model == "mlp"
    finally:
        channel.close()


def test_sigterm_drains_in_flight_requests():
    running = start()
    results = []
    rows = [float(v) for v in range(20)]  # 10 batches of 0.1 s
    caller = threading.Thread(target=lambda: results.append(running.infer_json("chunked", column(rows), timeout=60)))
    caller.start()
    until(lambda: running.queued_rows("chunked") > 0, "the request to be queued")  # in flight, however slow
    output = stop(running)
    caller.join(60)
    assert results and results[0][0] == 200 and results[0][1]["outputs"][0]["data"] == [2 * v for v in rows]
    assert "model 'chunked' drained and stopped" in output
    assert os.name != "posix" or running.process.returncode == 0


def test_drain_timeout_bounds_the_drain_and_answers_what_did_not_start():
    running = start("--drain-timeout", "0.25")
    results = []

    def call():
        try:
            results.append(running.infer_json("chunked", column([float(v) for v in range(20)]), timeout=30))
        except (OSError, ValueError, http.client.HTTPException) as error:  # cut off by the server on its way out
            results.append((None, error))

    caller = threading.Thread(target=call)  # 10 batches of 0.1 s
    caller.start()
    until(lambda: running.queued_rows("chunked") > 0, "the request to be queued")
    output = stop(running)
    caller.join(30)
    stats = re.search(r"model 'chunked' drained and stopped: (ServerStats\(.*\))", output).group(1)
    rows_run = int(re.search(r"\brows=(\d+)", stats).group(1))
    assert rows_run < 20, f"the drain stopped at its deadline: {stats}"
    assert results and results[0][0] == 503, "the request did not complete, and was not reported complete"
    assert "shut down before this request was answered" in results[0][1]["error"]


def test_a_second_server_on_a_taken_port_refuses_to_start_and_the_first_keeps_its_traffic(server):
    for ports in (["--port", str(free_port()), "--grpc-port", str(server.grpc_port)],
                  ["--port", str(server.port), "--grpc-port", str(free_port())]):
        taken = ports[3] if ports[3] == str(server.grpc_port) else ports[1]
        second = subprocess.run(
            [sys.executable, "-m", "jitserve", "serve", str(ROOT / "tests/protocol/network_models.py") + ":models",
             *ports], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].startswith(f"jitserve serve: port {taken} on 127.0.0.1 is taken")
        assert "compiled batch size" not in second.stderr + second.stdout, "the ports are checked before compiling"
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = np.random.default_rng(7).normal(size=(1, 16)).astype(np.float32)
    for _ in range(20):  # every call still reaches the first server
        tensor = grpcclient.InferInput("input", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("mlp", [tensor]).as_numpy("output"), reference_mlp(x), rtol=1e-5,
                                   atol=1e-6)


def test_sigterm_stops_both_fronts_at_once_and_answers_everything_accepted(gate):
    running = start(gate=gate)  # its batches held while the signal comes
    results: dict[str, object] = {}
    rows = [float(v) for v in range(8)]  # 4 batches of 0.1 s

    def http_call():
        results["http"] = running.infer_json("chunked", column(rows), timeout=30)

    def grpc_call():
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        tensor = grpcclient.InferInput("input", [len(rows), 1], "FP32")
        tensor.set_data_from_numpy(np.array(rows, np.float32)[:, None])
        results["grpc"] = client.infer("chunked", [tensor]).as_numpy("output").ravel().tolist()

    def draining() -> bool:
        try:
            return not client.is_server_ready()
        except InferenceServerException:
            return True

    callers = [threading.Thread(target=http_call), threading.Thread(target=grpc_call)]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
    with holding(gate, "chunked"):
        for caller in callers:
            caller.start()
        until(lambda: running.queued_rows("chunked") == 2 * len(rows) - 2, "both requests to be queued")
        running.process.send_signal(signal.SIGTERM)
        until(draining, "the server to report not ready")
        tensor = grpcclient.InferInput("input", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0]], np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("chunked", [tensor])
        assert "UNAVAILABLE" in str(refused.value.status()), "gRPC stops accepting when HTTP does"
        running.process.send_signal(signal.SIGTERM)  # a second one changes nothing
    for caller in callers:
        caller.join(30)
    output = stop(running)
    assert results["http"][0] == 200 and results["http"][1]["outputs"][0]["data"] == [2 * v for v in rows]
    assert results["grpc"] == [2 * v for v in rows], "every accepted request was answered"
    assert "SIGTERM while draining: ignored" in output and "Traceback" not in output


def test_sigterm_under_mixed_http_and_grpc_load_answers_every_accepted_request():
    running = start()
    outcomes: list[str] = []
    stopping = threading.Event()

    def http_caller(seed: int) -> None:
        while True:
            value = float(seed)
            try:
                status, body = running.infer_json("chunked", column([value]), timeout=30)
            except (ConnectionRefusedError, ConnectionResetError):
                # refused once the listener closed; reset when the kernel had queued the connection in the
                # listener's backlog as it closed: never accepted, so never a request the server dropped
                outcomes.append("refused")
                return
            if status == 200:
                assert body["outputs"][0]["data"] == [2 * value]
                outcomes.append("ok")
            else:
                assert status == 503, body
                outcomes.append("503")
            if stopping.is_set() and status != 200:
                return

    def grpc_caller(seed: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        while True:
            tensor = grpcclient.InferInput("input", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[seed]], np.float32))
            try:
                output = client.infer("chunked", [tensor]).as_numpy("output")
            except InferenceServerException as error:
                assert "UNAVAILABLE" in str(error.status()), error
                outcomes.append("unavailable")
                return
            assert output.tolist() == [[2.0 * seed]]
            outcomes.append("ok")

    def recorded(caller, seed: int) -> None:
        try:
            caller(seed)
        except BaseException as error:
            outcomes.append(f"{type(error).__name__}: {error}")

    callers = [threading.Thread(target=recorded, args=(kind, seed)) for seed in range(6)
               for kind in (http_caller, grpc_caller)]
    for caller in callers:
        caller.start()
    until(lambda: outcomes.count("ok") >= 12, "answers to the callers before the signal")
    stopping.set()
    output = stop(running)  # exits 0 (checked) once every accepted request was answered
    for caller in callers:
        caller.join(60)
    assert not any(caller.is_alive() for caller in callers)
    assert outcomes.count("ok") >= 12 and set(outcomes) <= {"ok", "503", "refused", "unavailable"}, outcomes
    assert "Traceback" not in output
