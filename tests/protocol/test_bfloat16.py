"""BF16 tensors on the wire (JAX's bfloat16, 2 bytes an element) against a real `jitserve serve`: tritonclient
over HTTP's binary extension and gRPC's raw contents, JSON numbers over raw HTTP; and, this server being
started without --allow-client-shm, shared memory refused as Triton refuses it by default."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from netutil import serving

ROOT = Path(__file__).resolve().parents[2]
MODELS = str(ROOT / "tests/protocol/wire_models.py") + ":models"
# values bfloat16 holds exactly (so that older tritonclients, which take float32 arrays for BF16 and cut
# each to its upper 2 bytes, send the bits newer ones send from ml_dtypes.bfloat16 arrays), halving exactly too
X = np.array([[1.5, -2.0, 3.25, 0.125], [8.0, 0.5, -0.75, 100.0], [-0.0, 2.0**-10, 98304.0, 2.0**127]], np.float32)


@pytest.fixture(scope="module")
def server():
    with serving(MODELS) as running:
        yield running


def as_dict(message_or_dict):
    if isinstance(message_or_dict, dict):
        return message_or_dict
    from google.protobuf import json_format

    return json_format.MessageToDict(message_or_dict, preserving_proto_field_name=True)


def test_metadata_and_config_say_bf16(triton):
    _, client = triton
    metadata = as_dict(client.get_model_metadata("halve"))
    tensors = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]])
               for t in metadata["inputs"] + metadata["outputs"]}
    assert tensors == {"input": ("BF16", [-1, 4]), "half": ("BF16", [-1, 4]), "total": ("FP32", [-1])}
    config = as_dict(client.get_model_config("halve"))
    config = config.get("config", config)
    assert [(t["name"], t["data_type"]) for t in config["input"] + config["output"]] == [
        ("input", "TYPE_BF16"), ("half", "TYPE_BF16"), ("total", "TYPE_FP32")]


def test_tritonclient_sends_and_reads_bf16(triton):
    """HTTP's binary tensor extension and gRPC's raw contents, 2 bytes an element each way; tritonclient's own
    numpy type for BF16 (ml_dtypes.bfloat16 in recent ones, float32 in older ones such as 2.48)."""
    module, client = triton
    tensor = module.InferInput("input", list(X.shape), "BF16")
    tensor.set_data_from_numpy(X.astype(triton_to_np_dtype("BF16")))
    outputs = [module.InferRequestedOutput(name) for name in ("half", "total")]
    result = client.infer("halve", [tensor], outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("half").astype(np.float32), X / 2)
    np.testing.assert_array_equal(result.as_numpy("total"), X.astype(np.float64).sum(axis=1).astype(np.float32))
    assert as_dict(result.get_output("half"))["datatype"] == "BF16"


def test_the_binary_bytes_are_bfloat16s():
    """What travels is each element's bfloat16 bits, little-endian: the float32's upper 2 bytes here."""
    from jitserve.protocol.codec import decode_raw, raw_contents

    wire = raw_contents(X.astype(ml_dtypes.bfloat16))
    assert wire == b"".join(value.tobytes()[2:] for value in X.reshape(-1))
    np.testing.assert_array_equal(decode_raw("input", "BF16", [3, 4], wire).astype(np.float32), X)


def infer_json(server, model, tensor, **request):
    status, _, body = server.request("POST", f"/v2/models/{model}/infer",
                                     json.dumps({"inputs": [tensor], **request}).encode())
    return status, json.loads(body)


def test_json_carries_bf16_as_numbers(server):
    """Triton refuses BF16 (and FP16) in JSON; jitserve reads and writes them as numbers, as its FP16: each
    read into bfloat16 (0.1 becomes 0.10009765625), each written exactly (a bfloat16 is a float32)."""
    status, body = infer_json(server, "halve", {"name": "input", "datatype": "BF16", "shape": [2, 4],
                                                "data": [0.1, "NaN", "-Infinity", 3, 1, 2, 4, 8]})
    assert status == 200, body
    half, total = body["outputs"]
    assert (half["name"], half["datatype"], half["shape"]) == ("half", "BF16", [2, 4])
    assert half["data"] == [0.050048828125, "NaN", "-Infinity", 1.5, 0.5, 1.0, 2.0, 4.0]
    assert (total["datatype"], total["data"]) == ("FP32", ["NaN", 15.0])
    status, body = infer_json(server, "halve", {"name": "input", "datatype": "BF16", "shape": [1, 4],
                                                "data": [1, 2, 3, 4]}, parameters={"binary_data_output": False})
    assert status == 200 and body["outputs"][0]["data"] == [0.5, 1.0, 1.5, 2.0]


@pytest.mark.parametrize("data, message", [
    ([1e39, 0, 0, 0], "input 'input': 1e+39 does not fit BF16, whose largest finite value is 3.38953e+38 (an "
                      "infinity is sent as \"Infinity\" or \"-Infinity\")"),
    ([True, 0, 0, 0], "input 'input': data must be BF16 values (true/false only for BOOL)"),
    (["1.5", 0, 0, 0], "input 'input': '1.5' is not a number (strings allowed in float data: NaN, Infinity, "
                       "-Infinity)"),
    ([1, 2, 3], "input 'input': 3 values, expected 4 for shape [1, 4]"),
])
def test_json_bf16_that_does_not_fit_is_refused_by_text(server, data, message):
    status, body = infer_json(server, "halve", {"name": "input", "datatype": "BF16", "shape": [1, 4], "data": data})
    assert (status, body) == (400, {"error": message})


def test_bf16_where_another_datatype_is_expected_and_the_reverse(server):
    status, body = infer_json(server, "halve", {"name": "input", "datatype": "FP32", "shape": [1, 4],
                                                "data": [1, 2, 3, 4]})
    assert (status, body) == (400, {"error": "input 'input' has datatype FP32, but model 'halve' expects BF16"})
    status, body = infer_json(server, "mlp", {"name": "input", "datatype": "BF16", "shape": [1, 16], "data": [0] * 16})
    assert (status, body) == (400, {"error": "input 'input' has datatype BF16, but model 'mlp' expects FP32"})


def test_grpc_bf16_needs_raw_contents(server):
    """As FP16, BF16 has no typed contents field in the protocol: raw_input_contents only."""
    from jitserve.protocol.grpc import MESSAGES

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                    response_deserializer=MESSAGES["ModelInferResponse"].FromString)
        request = MESSAGES["ModelInferRequest"](model_name="halve")
        request.inputs.add(name="input", datatype="BF16", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
        with pytest.raises(grpc.RpcError) as info:
            infer(request)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                             "input 'input': BF16 needs raw_input_contents")


def test_shared_memory_is_refused_unless_the_server_allows_it(triton):
    """Off by default, as Triton's --allow-client-shm: not listed among the extensions, registering refused."""
    module, client = triton
    metadata = as_dict(client.get_server_metadata())
    assert "system_shared_memory" not in metadata["extensions"] and "binary_tensor_data" in metadata["extensions"]
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("r", "/jitserve-test-key", 8)
    assert info.value.message() == "client shared memory is disabled: start the server with --allow-client-shm to " \
                                   "register and use shared memory regions"
    with pytest.raises(InferenceServerException, match="client shared memory is disabled"):
        client.unregister_system_shared_memory()
    tensor = module.InferInput("input", [1, 4], "BF16").set_shared_memory("r", 8)
    with pytest.raises(InferenceServerException, match="input 'input': client shared memory is disabled"):
        client.infer("halve", [tensor])
