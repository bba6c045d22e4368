"""Triton's system shared memory extension against a real `jitserve serve --allow-client-shm`, driven by
tritonclient (its ``tritonclient.utils.shared_memory`` regions, HTTP and gRPC clients) and raw requests."""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException, serialize_byte_tensor  # noqa: E402
from wire_models import gate_files  # noqa: E402

from netutil import serving  # noqa: E402
from waiting import until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODELS = str(ROOT / "tests/protocol/wire_models.py") + ":models"
KEYS = itertools.count()


@pytest.fixture(scope="module")
def server():
    with serving(MODELS, "--allow-client-shm") as running:
        yield running


@pytest.fixture
def client(triton):
    """A tritonclient of either protocol; every region it registered is unregistered after the test."""
    _, client = triton
    yield client
    client.unregister_system_shared_memory()


def module_of(client):
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


@pytest.fixture
def region():
    """make(size) -> (handle, key): a new POSIX shared memory object of ``size`` bytes, destroyed after the
    test."""
    made = []

    def make(size):
        key = f"/jitserve-test-{os.getpid()}-{next(KEYS)}"
        handle = shm.create_shared_memory_region(key[1:], key, size, create_only=True)
        made.append(handle)
        return handle, key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def statuses(client, name=""):
    """The registered regions as (name, key, offset, byte_size), sorted, from either client's status."""
    status = client.get_system_shared_memory_status(name)
    if isinstance(status, list):
        return sorted((r["name"], r["key"], r["offset"], r["byte_size"]) for r in status)
    return sorted((r.name, r.key, r.offset, r.byte_size) for r in status.regions.values())


def refusal(call) -> str:
    """The message of the error ``call()`` raises, which must be a client error (400 / INVALID_ARGUMENT)."""
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), info.value
    return info.value.message()


def mlp_input(client, rows, region_name, offset=0, byte_size=None):
    tensor = module_of(client).InferInput("input", [rows, 16], "FP32")
    return tensor.set_shared_memory(region_name, rows * 16 * 4 if byte_size is None else byte_size, offset=offset)


def shm_output(client, name, region_name, byte_size, offset=0):
    output = module_of(client).InferRequestedOutput(name)
    output.set_shared_memory(region_name, byte_size, offset=offset)  # (it returns None, not the output)
    return output


def mlp_output(client, region_name, byte_size, offset=0):
    return shm_output(client, "output", region_name, byte_size, offset)


def plain_mlp(client, x):
    tensor = module_of(client).InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("mlp", [tensor]).as_numpy("output")


def test_inputs_and_outputs_through_regions_equal_the_plain_path(client, region):
    x = np.random.default_rng(1).normal(size=(5, 16)).astype(np.float32)
    into, into_key = region(x.nbytes)
    out, out_key = region(5 * 4 * 4)
    shm.set_shared_memory_region(into, [x])
    client.register_system_shared_memory("in", into_key, x.nbytes)
    client.register_system_shared_memory("out", out_key, 5 * 4 * 4)
    result = client.infer("mlp", [mlp_input(client, 5, "in")], outputs=[mlp_output(client, "out", 80)])
    np.testing.assert_allclose(shm.get_contents_as_numpy(out, np.float32, [5, 4]), plain_mlp(client, x), rtol=1e-6)
    answer = result.get_output("output")
    if module_of(client) is httpclient:  # no data, as Triton answers an output written into shared memory
        assert answer == {"name": "output", "datatype": "FP32", "shape": [5, 4]}
    else:
        assert (answer.datatype, list(answer.shape)) == ("FP32", [5, 4])
        assert list(result.get_response().raw_output_contents) == [b""]


def test_one_region_holds_the_input_and_the_output_at_offsets(client, region):
    """A region from an offset of its object, and tensors at offsets into the region (as perf_analyzer and
    the C++ client lay several tensors in one region)."""
    x = np.random.default_rng(2).normal(size=(2, 16)).astype(np.float32)
    handle, key = region(1024)
    shm.set_shared_memory_region(handle, [x], offset=100 + 40)
    client.register_system_shared_memory("both", key, 600, offset=100)
    assert statuses(client) == [("both", key, 100, 600)]
    client.infer("mlp", [mlp_input(client, 2, "both", offset=40)], outputs=[mlp_output(client, "both", 32, offset=300)])
    np.testing.assert_allclose(shm.get_contents_as_numpy(handle, np.float32, [2, 4], offset=100 + 300),
                               plain_mlp(client, x), rtol=1e-6)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [2, 16], offset=140), x)


def test_status_lists_regions_and_unregister_removes_them(client, region):
    _, first = region(64)
    _, second = region(128)
    assert statuses(client) == []
    client.register_system_shared_memory("a", first, 64)
    client.register_system_shared_memory("b", second, 100, offset=28)
    assert statuses(client) == [("a", first, 0, 64), ("b", second, 28, 100)]
    assert statuses(client, "b") == [("b", second, 28, 100)]
    client.unregister_system_shared_memory("a")
    assert statuses(client) == [("b", second, 28, 100)]
    client.unregister_system_shared_memory("never-registered")  # no error, as in Triton
    client.unregister_system_shared_memory()
    assert statuses(client) == []
    client.register_system_shared_memory("a", second, 8)  # its name is free again
    assert statuses(client) == [("a", second, 0, 8)]


def test_bf16_in_a_region_and_outputs_both_ways_in_one_request(client, region):
    """BF16 takes 2 bytes an element in a region; one output into shared memory, the other in the answer."""
    x = np.array([[1.5, -2.0, 3.25, 0.125], [8.0, 0.5, -0.75, 100.0]], ml_dtypes.bfloat16)
    into, into_key = region(x.nbytes)
    out, out_key = region(x.nbytes)
    shm.set_shared_memory_region(into, [x])
    client.register_system_shared_memory("in", into_key, x.nbytes)
    client.register_system_shared_memory("out", out_key, x.nbytes)
    module = module_of(client)
    tensor = module.InferInput("input", [2, 4], "BF16").set_shared_memory("in", 16)
    outputs = [shm_output(client, "half", "out", 16), module.InferRequestedOutput("total")]
    result = client.infer("halve", [tensor], outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, ml_dtypes.bfloat16, [2, 4]), x / 2)
    np.testing.assert_array_equal(result.as_numpy("total"), x.astype(np.float32).sum(axis=1))


def test_bytes_tensors_through_regions(client, region):
    """BYTES elements in a region as the binary extension lays them out (a 4-byte length before each)."""
    texts = serialize_byte_tensor(np.array([b"ab", b"xyz"], dtype=object)).item()
    into, into_key = region(len(texts))
    out, out_key = region(64)
    shm.set_shared_memory_region(into, [np.array(texts, dtype=object)])
    client.register_system_shared_memory("in", into_key, len(texts))
    client.register_system_shared_memory("out", out_key, 64)
    module = module_of(client)
    tensor = module.InferInput("texts", [2], "BYTES").set_shared_memory("in", len(texts))
    client.infer("text", [tensor], outputs=[shm_output(client, "text", "out", 64)])
    assert list(shm.get_contents_as_numpy(out, np.object_, [2])) == [b"AB!", b"XYZ!"]


def test_every_bounds_error_is_a_clear_client_error(client, region, server):
    handle, key = region(64)
    shm.set_shared_memory_region(handle, [np.ones((1, 16), np.float32)])
    out_handle, out_key = region(64)
    client.register_system_shared_memory("r", key, 64)
    client.register_system_shared_memory("o", out_key, 64)
    infer = client.infer
    assert refusal(lambda: infer("mlp", [mlp_input(client, 1, "nope")])) == \
        "input 'input': no system shared memory region 'nope' is registered"
    assert refusal(lambda: infer("mlp", [mlp_input(client, 1, "r", offset=8)])) == \
        "input 'input': shared_memory_offset 8 + shared_memory_byte_size 64 = 72 runs past the end of shared " \
        "memory region 'r' (64 bytes)"
    assert refusal(lambda: infer("mlp", [mlp_input(client, 1, "r", byte_size=60)])) == \
        "input 'input': shared_memory_byte_size 60 does not match FP32 [1, 16], which takes 64 bytes"
    assert refusal(lambda: infer("mlp", [mlp_input(client, 1, "r")], outputs=[mlp_output(client, "o", 8)])) == \
        "output 'output': the shared memory given for it (shared_memory_byte_size 8) should be at least 16 bytes " \
        "to hold the results"
    assert refusal(lambda: infer("mlp", [mlp_input(client, 1, "r")], outputs=[mlp_output(client, "o", 72)])) == \
        "output 'output': shared_memory_offset 0 + shared_memory_byte_size 72 = 72 runs past the end of shared " \
        "memory region 'o' (64 bytes)"
    register = client.register_system_shared_memory
    assert refusal(lambda: register("r", key, 64)) == \
        f"failed to register shared memory region 'r': a region of that name is already registered (key '{key}', " \
        f"offset 0, 64 bytes); unregister it first"
    assert refusal(lambda: register("big", key, 128)) == \
        f"failed to register shared memory region 'big': offset 0 + byte_size 128 = 128 runs past the end of shared " \
        f"memory object '{key}' (64 bytes)"
    assert refusal(lambda: register("late", key, 64, offset=1)) == \
        f"failed to register shared memory region 'late': offset 1 + byte_size 64 = 65 runs past the end of shared " \
        f"memory object '{key}' (64 bytes)"
    assert refusal(lambda: register("ghost", "/jitserve-test-no-such-key", 8)) == \
        "failed to register shared memory region 'ghost': cannot open shared memory object " \
        "'/jitserve-test-no-such-key': no shared memory object of that key exists (create it first)"
    assert refusal(lambda: register("slash", "/a/b", 8)).endswith(
        "cannot open shared memory object '/a/b': it is not a valid shared memory key (a name such as '/my_region', "
        "no '/' after the first character, at most 255 characters)")
    assert refusal(lambda: register("empty", key, 0)) == \
        "failed to register shared memory region 'empty': 'byte_size' must be an integer >= 1, got 0"
    assert refusal(lambda: client.get_system_shared_memory_status("nope")) == \
        "shared memory status: no system shared memory region 'nope' is registered"
    np.testing.assert_allclose(  # the regions still serve
        infer("mlp", [mlp_input(client, 1, "r")]).as_numpy("output"), plain_mlp(client, np.ones((1, 16), np.float32)),
        rtol=1e-6)
    server.assert_healthy()


def test_cuda_shared_memory_is_answered_as_a_server_without_gpus(client):
    assert refusal(lambda: client.register_cuda_shared_memory(
        "gpu", "AAAA" if module_of(client) is httpclient else b"\0" * 64, 0, 64)) == \
        "failed to register CUDA shared memory region 'gpu': jitserve does not support CUDA shared memory; use " \
        "system shared memory (tritonclient.utils.shared_memory)"
    status = client.get_cuda_shared_memory_status()
    assert status == [] if module_of(client) is httpclient else not status.regions
    client.unregister_cuda_shared_memory()


def test_a_region_whose_object_shrank_is_refused_rather_than_read(client, region, server):
    """Reading a mapping past its object's end faults (SIGBUS): a region whose client truncated the object
    after registering it is refused, and the server lives on."""
    _, key = region(64)
    client.register_system_shared_memory("r", key, 64)
    os.truncate(Path("/dev/shm") / key[1:], 16)
    assert refusal(lambda: client.infer("mlp", [mlp_input(client, 1, "r")])) == \
        f"input 'input': shared memory object '{key}' of region 'r' shrank to 16 bytes since the region was " \
        f"registered (64 needed); register the region again"
    server.assert_healthy()


def mapped(server, key) -> bool:
    """Whether the server process maps the shared memory object ``key`` now."""
    return f"/dev/shm/{key[1:]}" in (Path("/proc") / str(server.process.pid) / "maps").read_text()


def test_unregister_unmaps_and_a_request_holding_a_region_finishes_with_it(client, region, server):
    """Unregistering takes effect for new requests at once; a request already holding the region reads its
    input and writes its output there all the same, and the mapping goes once it ends."""
    token = random.randrange(1, 2**20)
    started, go = gate_files(token)
    x = np.array([[token, 5.0]], np.float32)
    into, into_key = region(8)
    out, out_key = region(8)
    shm.set_shared_memory_region(into, [x])
    client.register_system_shared_memory("in", into_key, 8)
    client.register_system_shared_memory("out", out_key, 8)
    assert mapped(server, into_key) and mapped(server, out_key)
    module = module_of(client)
    port = server.port if module is httpclient else server.grpc_port
    results = []

    def call():
        with module.InferenceServerClient(f"127.0.0.1:{port}") as caller:
            tensor = module.InferInput("input", [1, 2], "FP32").set_shared_memory("in", 8)
            results.append(caller.infer("gate", [tensor], outputs=[shm_output(caller, "output", "out", 8)]))

    thread = threading.Thread(target=call)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started.exists(), "the gated request never started"
        client.unregister_system_shared_memory()
        assert statuses(client) == []
        assert refusal(lambda: client.infer("mlp", [mlp_input(client, 1, "in", byte_size=64)])) == \
            "input 'input': no system shared memory region 'in' is registered"
    finally:
        go.touch()
        thread.join(60)
        started.unlink(missing_ok=True)
        go.unlink(missing_ok=True)
    assert len(results) == 1
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [1, 2]), x + 1)
    # the answer is sent before the request's last references go
    until(lambda: not mapped(server, into_key) and not mapped(server, out_key), "the regions to be unmapped")


# the same extension over raw HTTP and gRPC messages: what tritonclient never sends ---------------------------

def post(server, path, payload):
    status, _, body = server.request("POST", path, json.dumps(payload).encode())
    return status, json.loads(body) if body else None


def test_raw_http_requests_that_misplace_shared_memory_parameters(server, region):
    handle, key = region(64)
    assert post(server, "/v2/systemsharedmemory/region/r/register", {"key": key, "byte_size": 64}) == (200, {})
    cases = [
        ({"data": [0.0] * 16, "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64}},
         "input 'input' has both 'data' and a shared_memory_region parameter; send one"),
        ({"parameters": {"shared_memory_region": "r"}},
         "input 'input': 'shared_memory_region' needs 'shared_memory_byte_size', the tensor's size in bytes"),
        ({"parameters": {"shared_memory_offset": 8}},
         "input 'input': 'shared_memory_offset' is given without 'shared_memory_region'"),
        ({"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": -8}},
         "input 'input': 'shared_memory_offset' must be an integer >= 0, got -8"),
        ({"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": "64"}},
         "input 'input': 'shared_memory_byte_size' must be an integer >= 0, got '64'"),
        ({"parameters": {"shared_memory_region": 5, "shared_memory_byte_size": 64}},
         "input 'input': 'shared_memory_region' must be a region's name (a non-empty string), got 5"),
    ]
    for tensor, message in cases:
        status, body = post(server, "/v2/models/mlp/infer",
                            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], **tensor}]})
        assert (status, body) == (400, {"error": message})
    for also, what in [({"binary_data": True}, "binary data"), ({"classification": 2}, "classified")]:
        output = {"name": "output", "parameters": {**also, "shared_memory_region": "r", "shared_memory_byte_size": 64}}
        status, body = post(server, "/v2/models/mlp/infer", {"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}], "outputs": [output]})
        assert (status, body) == (400, {"error": f"output 'output': an output written into shared memory cannot also "
                                                 f"be {what}; send one"})
    for payload, message in [
            ({"byte_size": 8}, "failed to register shared memory region 'x': 'key' must be a shared memory object's "
                               "name, such as '/my_region', got None"),
            ({"key": key}, "failed to register shared memory region 'x': 'byte_size' must be an integer >= 1, got None"),
            ({"key": key, "byte_size": 8, "offset": -1},
             "failed to register shared memory region 'x': 'offset' must be an integer >= 0, got -1"),
            ([key, 8], 'the register request must be a JSON object {"key", "offset", "byte_size"}')]:
        assert post(server, "/v2/systemsharedmemory/region/x/register", payload) == (400, {"error": message})
    assert post(server, "/v2/systemsharedmemory/register", {"key": key, "byte_size": 8}) == \
        (400, {"error": "a shared memory region needs a name to be registered under"})
    assert server.request("GET", "/v2/systemsharedmemory/region/r/register")[0] == 405
    assert post(server, "/v2/systemsharedmemory/unregister", {}) == (200, {})
    server.assert_healthy()


def test_raw_grpc_requests_that_misplace_shared_memory_parameters(server, region):
    from jitserve.protocol.grpc import MESSAGES

    _, key = region(64)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    register = channel.unary_unary("/inference.GRPCInferenceService/SystemSharedMemoryRegister",
                                   request_serializer=MESSAGES["SystemSharedMemoryRegisterRequest"].SerializeToString,
                                   response_deserializer=MESSAGES["SystemSharedMemoryRegisterResponse"].FromString)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                response_deserializer=MESSAGES["ModelInferResponse"].FromString)
    try:
        with pytest.raises(grpc.RpcError) as info:
            register(MESSAGES["SystemSharedMemoryRegisterRequest"](key=key, byte_size=64))
        assert info.value.details() == "a shared memory region needs a name to be registered under"
        register(MESSAGES["SystemSharedMemoryRegisterRequest"](name="g", key=key, byte_size=64))
        request = MESSAGES["ModelInferRequest"](model_name="mlp")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
        tensor.parameters["shared_memory_region"].string_param = "g"
        tensor.parameters["shared_memory_byte_size"].int64_param = 64
        tensor.contents.fp32_contents.extend([0.0] * 16)
        with pytest.raises(grpc.RpcError) as info:
            infer(request)
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "input 'input' has both contents and shared_memory_region; send one")
        tensor.ClearField("contents")
        request.raw_input_contents.append(np.zeros(16, np.float32).tobytes())
        with pytest.raises(grpc.RpcError) as info:
            infer(request)
        assert info.value.details() == "raw_input_contents has 1 entries for 0 inputs not in shared memory"
        del request.raw_input_contents[:]
        assert list(infer(request).outputs[0].shape) == [1, 4]
        output = request.outputs.add(name="output")
        output.parameters["shared_memory_region"].string_param = "g"
        output.parameters["shared_memory_byte_size"].int64_param = 16
        output.parameters["classification"].int64_param = 2
        with pytest.raises(grpc.RpcError) as info:
            infer(request)
        assert info.value.details() == "output 'output': an output written into shared memory cannot also be " \
                                       "classified; send one"
    finally:
        channel.close()



def test_grpc_streams_read_and_write_regions_too(server, region):
    """ModelStreamInfer (tritonclient's start_stream, perf_analyzer's streaming mode) places tensors as
    ModelInfer does."""
    x = np.random.default_rng(3).normal(size=(2, 16)).astype(np.float32)
    into, into_key = region(x.nbytes)
    out, out_key = region(32)
    shm.set_shared_memory_region(into, [x])
    answers = []
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        client.register_system_shared_memory("in", into_key, x.nbytes)
        client.register_system_shared_memory("out", out_key, 32)
        client.start_stream(callback=lambda result, error: answers.append((result, error)))
        client.async_stream_infer("mlp", [mlp_input(client, 2, "in")], outputs=[mlp_output(client, "out", 32)])
        client.stop_stream()
        expected = plain_mlp(client, x)
        client.unregister_system_shared_memory()
    assert [error for _, error in answers] == [None]
    np.testing.assert_allclose(shm.get_contents_as_numpy(out, np.float32, [2, 4]), expected, rtol=1e-6)
