"""Issue 31's findings against the real `jitserve serve`: a model's own exceptions, gRPC streams that are not
read or stay open at SIGTERM, and error replies that name their request. Loopback only; every load is bounded
in count and time."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

pytest.importorskip("uvicorn")

from gates import gate_env, holding, started

import jitserve as js
from jitserve.protocol.grpc import MESSAGES, GrpcFront, StreamCall
from jitserve.protocol.limits import Limits
from jitserve.protocol.service import NO_SPAN, NoSpan
from netutil import Running, start_server, stop
from waiting import HANG_S, until

MODELS = str(Path(__file__).with_name("hostile_models.py")) + ":models"
STREAM_REQUESTS = 4
STREAM_BUFFER = 8 * 2**20


@pytest.fixture(scope="module")
def server():
    running = start_server(MODELS, "--write-timeout", "2", "--max-stream-requests", str(STREAM_REQUESTS),
                           "--stream-buffer-bytes", str(STREAM_BUFFER))
    yield running
    stop(running)


def logged(running: Running, text: str) -> bool:
    """Whether the server's log shows ``text``, waiting for it as long as a busy machine may need."""
    until(lambda: text in running.output(), f"{text!r} in the server's log")
    return True


def infer_request(model: str, values, request_id: str = "") -> object:
    request = MESSAGES["ModelInferRequest"](model_name=model, id=request_id)
    array = np.asarray(values, np.float32).reshape(-1, 1)
    request.inputs.add(name="input", datatype="FP32", shape=list(array.shape))
    request.raw_input_contents.append(array.tobytes())
    return request


def channel_to(running: Running) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}",
                                     options=[("grpc.max_receive_message_length", 64 * 2**20)])


def open_stream(channel: grpc.aio.Channel):
    return channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                 request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                 response_deserializer=MESSAGES["ModelStreamInferResponse"].FromString)()


def json_input(value: float) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


def resident(running: Running | None) -> int:
    """The resident bytes of ``running``'s server (None: of this process)."""
    for line in Path(f"/proc/{'self' if running is None else running.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc")


# a model's own exceptions -------------------------------------------------------------------------------

def test_a_models_exceptions_are_500_whatever_their_class_and_model_error_speaks_on_purpose(server):
    for value in range(5):  # TimeoutError, BatchError, ProtocolError, QueueFullError, UnknownServerError
        status, body = server.infer_json("raises", json_input(value))
        assert status == 500, (value, body)
        assert "internal error in model 'raises'; the server log has the details under request id" in body["error"]
        assert "secret" not in body["error"]
    assert server.infer_json("raises", json_input(5)) == (422, {"error": "the input must be below 5"})
    assert server.infer_json("raises", json_input(6)) == (400, {"error": "said on purpose"})

    async def over_grpc() -> list[tuple[str, str]]:
        async with channel_to(server) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                        response_deserializer=MESSAGES["ModelInferResponse"].FromString)
            answers = []
            for value in (3, 5):
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await infer(infer_request("raises", [value]), timeout=30)
                answers.append((failure.value.code().name, failure.value.details()))
            return answers

    (internal, internal_text), said = asyncio.run(over_grpc())
    assert internal == "INTERNAL" and "secret" not in internal_text
    assert said == ("INVALID_ARGUMENT", "the input must be below 5")
    assert logged(server, "Traceback (most recent call last)")  # the model's own failures, logged whole
    server.assert_healthy()


def test_model_error_takes_only_statuses_the_protocols_can_say():
    assert js.ModelError("x", status=503).status == 503
    with pytest.raises(js.OptionError, match="ModelError status must be one of 400, 401, .*; got 299"):
        js.ModelError("x", status=299)


# gRPC streams -------------------------------------------------------------------------------------------

def test_a_stream_that_is_never_read_holds_bounded_memory_and_is_cut_off_after_the_write_timeout(server):
    baseline, cut_before = resident(server), server.output().count("stopped reading its replies")

    async def flood() -> tuple[int, int, str]:
        async with channel_to(server) as channel:
            call = open_stream(channel)
            for index in range(100):  # 100 x 8 rows (3 KB): 800 MiB of replies, were they all made at once
                await call.write(infer_request("wide", np.arange(8), f"r{index}"))
            peak = 0
            while server.output().count("stopped reading its replies") == cut_before:  # the 2 s write timeout
                peak = max(peak, resident(server) - baseline)
                await asyncio.sleep(0.05)
            received = 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in call:
                    received += 1
            return peak, received, f"{ended.value.code().name}: {ended.value.details()}"

    peak, received, ended = asyncio.run(asyncio.wait_for(flood(), HANG_S))
    # what one stream may hold: the reply buffer and a reply per request in flight (each made, encoded and
    # serialized: a few copies of 8 MiB at a time), not the 800 MiB of all its replies
    assert peak < 200 * 2**20, f"grew {peak / 2**20:.0f} MiB"
    assert ended == "UNAVAILABLE: the client did not read its replies for 2 s (--write-timeout)"
    assert received < STREAM_REQUESTS + 4
    assert logged(server, "stopped reading its replies for 2 s (--write-timeout): stream ended")
    server.assert_healthy()


def test_a_stream_that_reads_gets_every_reply_through_its_caps(server):
    async def read_all() -> dict[str, float]:
        async with channel_to(server) as channel:
            call = open_stream(channel)

            async def send() -> None:
                for index in range(40):
                    await call.write(infer_request("wide", [index] * 3, f"r{index}"))
                await call.done_writing()

            sender = asyncio.ensure_future(send())
            rows: dict[str, list[float]] = {}  # a request's rows come in one reply per batch that ran some
            async for reply in call:
                assert reply.error_message == "", reply.error_message
                output = np.frombuffer(reply.infer_response.raw_output_contents[0], np.float32).reshape(-1, 2**18)
                rows.setdefault(reply.infer_response.id, []).extend(output[:, -1].tolist())
            await sender
            return rows

    rows = asyncio.run(asyncio.wait_for(read_all(), 60))
    assert rows == {f"r{index}": [float(index)] * 3 for index in range(40)}


REPLY_BYTES = 64 * 2**20


class OneOutput:
    """An InferenceService's part a stream's answer uses, streaming one output of ``REPLY_BYTES`` per request."""

    tracing = shared_memory = None

    async def infer_stream(self, *_: object) -> tuple[str, object]:
        async def outputs():
            yield [("output", np.ones(REPLY_BYTES, np.uint8))]  # its pages written: resident

        return "1", outputs()

    def count(self, *_: object) -> None:
        pass

    def span(self, *_: object) -> NoSpan:
        return NO_SPAN


def test_a_reply_that_waits_for_room_in_the_stream_buffer_is_held_once():
    """Issue 56's regression of ce0501a: the answer kept its reply alive across the await of the stream's
    buffer beside the stream message that copies it, so each waiting reply was held twice. Measured when the
    reply is handed to the buffer: the output and one reply are resident, not a copy more."""
    call = StreamCall(GrpcFront(OneOutput(), Limits()), context=None)
    grown: list[int] = []

    async def put(message) -> None:  # where a reply waits for room: what the answer holds across it is resident
        grown.append(resident(None) - baseline)
        assert message.infer_response.raw_output_contents[0][:1] == b"\x01"

    call._put = put
    baseline = resident(None)
    asyncio.run(call._answer(MESSAGES["ModelInferRequest"](model_name="m", id="r").SerializeToString()))
    (held,) = grown
    assert held < 2.5 * REPLY_BYTES, f"{held / REPLY_BYTES:.1f} replies' bytes resident while the reply waits"


def test_stream_error_replies_name_their_request(server):
    async def errors() -> list:
        async with channel_to(server) as channel:
            call = open_stream(channel)
            await call.write(infer_request("slow", [1.0], "fine"))
            await call.write(infer_request("nope", [1.0], "lost"))
            bad = infer_request("slow", [1.0], "malformed")
            bad.inputs[0].shape[:] = [3, 1]
            await call.write(bad)
            await call.done_writing()
            return [reply async for reply in call]

    replies = {reply.infer_response.id: reply for reply in asyncio.run(asyncio.wait_for(errors(), 60))}
    assert set(replies) == {"fine", "lost", "malformed"}
    assert replies["fine"].error_message == ""
    assert replies["lost"].error_message.startswith("request 'lost': unknown model 'nope'")
    assert replies["lost"].infer_response.model_name == "nope"
    assert replies["malformed"].error_message == ("request 'malformed': input 'input': 4 bytes of binary data, "
                                                  "expected 12 for FP32 [3, 1]")


def not_ready(running: Running) -> bool:
    """Whether the server says it is not ready, or no longer takes connections."""
    try:
        return running.request("GET", "/v2/health/ready")[0] == 503
    except OSError:
        return True


def test_sigterm_ends_an_open_stream_once_it_has_answered_what_it_accepted(tmp_path):
    running = start_server(MODELS, "--drain-timeout", "600", env=gate_env(tmp_path))

    async def at_shutdown() -> tuple[list, str]:
        async with channel_to(running) as channel:
            call = open_stream(channel)
            with holding(tmp_path, "slow"):
                await call.write(infer_request("slow", [1.0], "accepted"))
                await asyncio.to_thread(until, lambda: started(tmp_path, "slow") == 1, "the request to run")
                running.process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(until, lambda: not_ready(running), "the server to stop accepting")
                try:
                    await call.write(infer_request("slow", [2.0], "late"))
                except grpc.aio.AioRpcError:
                    pass  # the stream already ended
            replies = []
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for reply in call:
                    replies.append(reply)
            return replies, f"{ended.value.code().name}: {ended.value.details()}"

    try:
        replies, ended = asyncio.run(asyncio.wait_for(at_shutdown(), HANG_S))
        running.process.wait(timeout=HANG_S)  # not the 600 s grace: nothing was left to wait for
    finally:
        if running.process.poll() is None:
            running.process.kill()
    answered = {reply.infer_response.id: reply for reply in replies}
    assert answered["accepted"].error_message == ""
    assert np.frombuffer(answered["accepted"].infer_response.raw_output_contents[0], np.float32).tolist() == [2.0]
    if "late" in answered:  # read before the stream ended: refused, not run
        assert "the server is shutting down" in answered["late"].error_message
    assert ended.startswith("UNAVAILABLE: the server is shutting down")
    assert running.process.returncode == 0


# file descriptors ---------------------------------------------------------------------------------------

def descriptors(running: Running) -> int:
    return len(list(Path(f"/proc/{running.process.pid}/fd").iterdir()))


def settle(running: Running, baseline: int, seconds: float = HANG_S) -> int:
    """The server's open descriptors once back within a few of ``baseline`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while (count := descriptors(running)) > baseline + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def http_answer(connection: socket.socket) -> bytes:
    """What the server sends on ``connection`` until it closes; a reset before any answer raises."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    return data


def test_at_1024_descriptors_idle_grpc_connections_and_a_refused_burst_leave_http_answering(certificate):
    running = start_server(MODELS, "--read-timeout", "2", open_files=1024)
    held: list[socket.socket] = []
    try:
        output = running.output()
        assert "connection caps lowered to fit the 1024 files the process may open: --max-connections 4096 -> " \
               "614, --max-grpc-connections 1024 -> 154" in output
        baseline = descriptors(running)
        for _ in range(1100):  # idle TCP connections to the gRPC port: once, they took every descriptor
            held.append(socket.create_connection(("127.0.0.1", running.grpc_port)))
        assert running.request("GET", "/v2/health/ready")[0] == 200
        for _ in range(614):  # HTTP connections up to the cap
            held.append(socket.create_connection(("127.0.0.1", running.port)))
        burst = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(600)]
        answers = []
        for connection in burst:  # each is answered 503 with Retry-After, none reset
            connection.settimeout(10)
            answers.append(http_answer(connection))
            connection.close()
        assert all(answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer for answer in answers)
        for connection in held:
            connection.close()
        held.clear()
        assert settle(running, baseline) <= baseline + 4
        assert running.infer_json("slow", json_input(1.0)) == (200, running.infer_json("slow", json_input(1.0))[1])
    finally:
        for connection in held:
            connection.close()
        output = stop(running)
    assert "Traceback" not in output


def test_stalled_tls_handshakes_are_counted_and_cut_at_the_read_timeout(certificate):
    cert, key = certificate
    running = start_server(MODELS, "--tls-cert", str(cert), "--tls-key", str(key), "--read-timeout", "1",
                           "--max-connections", "10", tls_ca=str(cert))
    try:
        baseline = descriptors(running)
        stalled = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(10)]
        extra = socket.create_connection(("127.0.0.1", running.port))  # past the cap: closed before a handshake
        extra.settimeout(10)
        assert http_answer(extra) == b""
        for connection in stalled:  # no ClientHello for 1 s: closed
            connection.settimeout(10)
            assert http_answer(connection) == b""
        assert settle(running, baseline) <= baseline + 4
        status, _, _ = running.request("GET", "/v2/health/ready")
        assert status == 200
    finally:
        output = stop(running)
    assert "TLS connection closed before its handshake: the server holds its limit of 10 open connections" in output


# protocol features jitserve does not implement: refused, not ignored --------------------------------------

def test_sequence_parameters_are_refused_not_ignored(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    payload = json_input(1.0)
    status, body = server.infer_json("slow", {**payload, "parameters": {"sequence_id": 7, "sequence_start": True}})
    assert (status, body["error"]) == (400, "the request: the 'sequence_id' parameter is not supported: jitserve has "
                                            "no sequence batching (Triton's stateful models); each request stands "
                                            "alone")
    status, body = server.infer_json("slow", {**payload, "parameters": {"classification": 3}})
    assert (status, body["error"]) == (400, "the request: the 'classification' parameter is not supported: it is a "
                                            "parameter of a requested output (tritonclient's InferRequestedOutput("
                                            "name, class_count=k)), not of the request")
    for module, port in ((httpclient, server.port), (grpcclient, server.grpc_port)):
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = module.InferInput("input", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.float32([[1.0]]))
        with pytest.raises(InferenceServerException, match="the 'sequence_(id|start|end)' parameter is not supported"):
            client.infer("slow", [tensor], sequence_id=7, sequence_start=True)
        assert client.infer("slow", [tensor]).as_numpy("output").tolist() == [[2.0]]


def test_classification_as_triton_answers_it(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    for module, port in ((httpclient, server.port), (grpcclient, server.grpc_port)):
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = module.InferInput("input", [2, 1], "FP32")
        tensor.set_data_from_numpy(np.float32([[1.0], [-2.0]]))

        def classes(count, model="scores"):
            result = client.infer(model, [tensor], outputs=[module.InferRequestedOutput("output", class_count=count)])
            return result.as_numpy("output").tolist()

        assert classes(3) == [[b"0.900000:1:dog", b"0.750000:3:owl", b"0.500000:2:cow"],
                              [b"-0.200000:0:cat", b"-0.400000:4", b"-1.000000:2:cow"]]
        assert len(classes(9)[0]) == 5, "a count beyond the classes gives them all, as Triton's"
        assert classes(20_000) == classes(5), "a large count is formatted off the event loop, alike"
        assert classes(1, "slow") == [[b"2.000000:0"], [b"-1.000000:0"]], "no labels: value:index"
        assert client.infer("scores", [tensor]).as_numpy("output").shape == (2, 5), "no count: the tensor itself"
    status, body = server.infer_json("scores", {**json_input(1.0), "outputs": [
        {"name": "output", "parameters": {"classification": "three"}}]})
    assert (status, body["error"]) == (400, "output 'output': the 'classification' parameter must be a whole number "
                                            "of classes >= 0, got 'three'")
    status, body = server.infer_json("scores", {**json_input(1.0), "outputs": [
        {"name": "output", "parameters": {"classification": 2}}]})
    assert status == 200 and body["outputs"][0] == {"name": "output", "datatype": "BYTES", "shape": [1, 2],
                                                    "data": ["0.900000:1:dog", "0.750000:3:owl"]}
    assert "classification" in json.loads(server.request("GET", "/v2")[2])["extensions"]


@pytest.mark.parametrize("shape", [[30_000_000], [2_147_483_647], [2**31 - 1, 2**31 - 1]])
def test_a_bytes_shape_larger_than_its_data_is_refused_before_memory_is_spent(shape):
    """Each BYTES element carries at least its 4-byte length: a shape that the binary data cannot hold is a
    400 before a slot per element is allocated (it cost 229 MiB for [30000000] on a 4-byte body)."""
    import tracemalloc

    from jitserve.errors import ProtocolError
    from jitserve.protocol.codec import decode_raw

    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"input 't': shape .* BYTES elements, each at least a 4-byte "
                                                   r"length, but the binary data has 4 bytes"):
            decode_raw("t", "BYTES", shape, b"\0\0\0\0")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
