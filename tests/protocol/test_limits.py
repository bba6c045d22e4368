"""The real `jitserve serve` under its client limits: stalled and oversized requests, too many connections,
clients that stop reading, bursts of gRPC calls and very large JSON bodies, each answered clearly while the
server goes on serving. Loopback only; every load is bounded in count and time."""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

pytest.importorskip("uvicorn")

from jitserve.protocol.grpc import MESSAGES
from netutil import Running, start_server, stop
from waiting import until

MODELS = str(Path(__file__).with_name("limit_models.py")) + ":models"
MAX_HEADER = 2000
MAX_CONNECTIONS = 40
MAX_GRPC_CALLS = 100
BIG_BODY = 80 * 2**20


@pytest.fixture(scope="module")
def server():
    running = start_server(MODELS, "--read-timeout", "1", "--write-timeout", "1", "--max-header-bytes",
                           str(MAX_HEADER), "--max-connections", str(MAX_CONNECTIONS), "--max-grpc-calls",
                           str(MAX_GRPC_CALLS), "--max-body-bytes", str(BIG_BODY))
    yield running
    output = stop(running)
    assert "stopped reading its response for 1 s (--write-timeout): connection aborted" in output
    assert "Traceback" not in output


def connect(server: Running) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port))
    connection.settimeout(10)
    return connection


def answer(connection: socket.socket) -> tuple[int, dict]:
    """Read what the server sends until it closes; the status and the JSON body."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    connection.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)


def assert_serves(server: Running) -> None:
    """The server still answers an inference correctly."""
    x = np.arange(16, dtype=np.float32)[None]
    status, body = server.infer_json("bulk", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                                          "data": x.ravel().tolist()}]})
    assert status == 200 and body["outputs"][0]["data"] == (2 * x).ravel().tolist()


def test_headers_that_never_finish_are_408(server):
    stalled = connect(server)
    stalled.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
    assert answer(stalled) == (408, {"error": "the request line and headers did not arrive within 1 s "
                                              "(--read-timeout)"})
    silent = connect(server)  # connects and sends nothing
    assert answer(silent)[0] == 408
    assert_serves(server)


def test_a_body_that_stalls_is_408_and_nothing_of_it_runs(server):
    stalled = connect(server)
    stalled.sendall(b"POST /v2/models/bulk/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"inputs\"")
    assert answer(stalled) == (408, {"error": "the request body paused for more than 1 s (--read-timeout); "
                                              "nothing ran"})
    assert_serves(server)


def test_headers_over_the_limit_are_431(server):
    for request in (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEADER + b"\r\n\r\n",
                    b"GET /v2/health/live HTTP/1.1\r\nX-Endless: " + b"a" * 3 * MAX_HEADER):  # still coming
        connection = connect(server)
        connection.sendall(request)
        assert answer(connection) == (431, {"error": f"the request line and headers exceed the limit of "
                                                     f"{MAX_HEADER} bytes (--max-header-bytes)"})
    assert_serves(server)


def test_connections_beyond_the_cap_are_refused_503_and_the_server_keeps_serving(server):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # idle connections up to the cap (fewer if the server has others)
            held.append(connect(server))
        extra = connect(server)  # accepted after them (one listener: in the order they came), within 1 s of them
        extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = answer(extra)
        assert status == 503
        assert body == {"error": f"the server holds its limit of {MAX_CONNECTIONS} open connections; retry later"}
    finally:
        for connection in held:
            connection.close()
    until(lambda: server.request("GET", "/v2/health/live")[0] == 200, "the server to let the closed ones go")
    assert_serves(server)


def test_a_client_that_stops_reading_is_cut_off_and_its_response_freed(server):
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [4, 1],
                                   "data": [1.0, 2.0, 3.0, 4.0]}]}).encode()
    readers, cut = [], "stopped reading its response for 1 s (--write-timeout): connection aborted"
    before = server.output().count(cut)
    for _ in range(6):  # six 16 MiB responses that nobody reads
        connection = socket.create_connection(("127.0.0.1", server.port))
        connection.sendall(b"POST /v2/models/spread/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(body), body))
        readers.append(connection)
    until(lambda: server.output().count(cut) == before + 6, "the server to cut off the 6 readers")
    for connection in readers:  # each connection was aborted: reading ends with a reset or EOF, not 16 MiB
        connection.settimeout(10)
        received = 0
        try:
            while chunk := connection.recv(2**20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 16 * 2**20
        connection.close()
    assert_serves(server)


def test_a_burst_of_grpc_calls_is_answered_or_refused_resource_exhausted_never_cancelled(server):
    request = MESSAGES["ModelInferRequest"](model_name="sleepy")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.float32([1.0]).tobytes())

    async def burst() -> collections.Counter:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") for _ in range(4)]
        codes: collections.Counter = collections.Counter()

        async def call(index: int) -> None:
            infer = channels[index % 4].unary_unary(
                "/inference.GRPCInferenceService/ModelInfer", request_serializer=type(request).SerializeToString,
                response_deserializer=MESSAGES["ModelInferResponse"].FromString)
            try:
                reply = await infer(request, timeout=60)
                assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2.0]
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "Concurrent RPC limit exceeded" in error.details()

        await asyncio.gather(*(call(index) for index in range(2000)))
        for channel in channels:
            await channel.close()
        return codes

    codes = asyncio.run(burst())
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and sum(codes.values()) == 2000, codes
    assert codes["OK"] >= MAX_GRPC_CALLS and codes["RESOURCE_EXHAUSTED"] > 0, codes
    assert_serves(server)


def test_large_json_bodies_do_not_stall_other_requests_and_memory_stays_bounded(server):
    rows = 150_000  # about 45 MiB of JSON
    x = np.random.default_rng(0).random((rows, 16), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 16],
                                   "data": x.ravel().tolist()}]}).encode()
    baseline = resident(server, "VmRSS")
    results = []

    def large() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        connection.request("POST", "/v2/models/bulk/infer", body)
        response = connection.getresponse()
        results.append((response.status, response.read()))

    health_answers: list[int] = []
    callers = [threading.Thread(target=large) for _ in range(4)]
    for caller in callers:
        caller.start()
    while any(caller.is_alive() for caller in callers):  # health is answered while the large ones are handled
        health_answers.append(server.request("GET", "/v2/health/live", timeout=60)[0])
        time.sleep(0.05)
    assert len(results) == 4
    for status, data in results:
        assert status == 200
        output = json.loads(data)["outputs"][0]
        np.testing.assert_array_equal(np.asarray(output["data"], np.float32).reshape(output["shape"]), 2 * x)
    assert len(health_answers) >= 2 and set(health_answers) == {200}
    growth = resident(server, "VmHWM") - baseline
    assert growth < 6 * 4 * len(body), f"peak memory grew {growth / 2**20:.0f} MiB for 4 x {len(body) / 2**20:.0f} MiB"
    assert_serves(server)


def resident(server: Running, field: str) -> int:
    """The server process's resident memory now (VmRSS) or at its peak so far (VmHWM), bytes."""
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc")


def test_the_largest_limits_start_a_server_and_one_beyond_is_one_line():
    """Every limit at its largest (32-bit counts, seconds as 32-bit milliseconds) starts and serves over
    HTTP and gRPC; one beyond is refused at start with one line, never an OverflowError traceback."""
    import tritonclient.grpc as grpcclient


    largest = ["--read-timeout", "2147483", "--write-timeout", "2147483", "--idle-timeout", "2147483",
               "--max-body-bytes", "2147483647", "--max-grpc-calls", "2147483647", "--max-connections", "2147483647",
               "--max-grpc-connections", "2147483647", "--stream-buffer-bytes", "2147483647"]
    running = start_server(MODELS, *largest)
    try:
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}").is_server_ready()
    finally:
        output = stop(running)
    assert "Traceback" not in output
    for flag, value in (("--idle-timeout", "2592000"), ("--max-body-bytes", "3000000000")):
        done = subprocess.run([sys.executable, "-m", "jitserve", "serve", MODELS, flag, value, "--port", "0"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "must be at most" in done.stderr
