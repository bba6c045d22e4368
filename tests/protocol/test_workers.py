"""`jitserve serve --http-workers N`: front processes on one port over one engine, driven by real HTTP clients
over loopback. Which front took a connection is read from /proc (the front process that holds the server's
end of the client's socket); which rows ran together, from the gated models' record of their batches
(tests/protocol/worker_models.py); what waits in the engine, from its /metrics. Nothing is timed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from netutil import ROOT, front_processes, start_server, stop

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

MODELS = "tests/protocol/worker_models.py:models"
DEADLINE = 120  # a bound for a state to be reached on a busy machine; no assertion is on time


@contextlib.contextmanager
def gated_server(tmp_path, *extra):
    """A server of the test models whose gated batches wait while ``hold`` exists and are written to
    ``batches``: (running, hold, batches)."""
    hold, batches = tmp_path / "hold", tmp_path / "batches"
    running = start_server(MODELS, *extra, env={"JITSERVE_TEST_HOLD": str(hold), "JITSERVE_TEST_BATCHES": str(batches)})
    try:
        yield running, hold, batches
    finally:
        hold.unlink(missing_ok=True)  # a test that failed holding its batches must not hold the drain
        if running.process.poll() is None:
            stop(running)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with gated_server(tmp_path_factory.mktemp("workers"), "--http-workers", "4") as gated:
        yield gated


def sockets(running, pids) -> list[tuple[str, str, int]]:
    """The TCP sockets on the server's port that the processes ``pids`` hold: (state, remote address, pid);
    state ``0A`` is listening."""
    inodes = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if int(local.rsplit(":", 1)[1], 16) == running.port and inode in inodes:
                found.append((state, remote, inodes[inode]))
    return found


def owners(running, pids) -> dict[int, int]:
    """Client port -> the pid of the front process that holds the server's end of that connection."""
    return {int(remote.rsplit(":", 1)[1], 16): pid for state, remote, pid in sockets(running, pids) if state != "0A"}


def listening(running) -> list[int]:
    """The front processes listening on the port now."""
    return sorted(pid for state, _, pid in sockets(running, front_processes(running.process.pid)) if state == "0A")


def rings(pid: int | str = "self") -> int:
    """The fronts' rings a process maps (each memfd is named so)."""
    return Path(f"/proc/{pid}/maps").read_text().count("jitserve-http-ring")


def wait_for(condition, what):
    """Poll ``condition`` until it holds; a connection that a killed front took and reset is one more try."""
    deadline = time.monotonic() + DEADLINE
    while True:
        with contextlib.suppress(ConnectionError, http.client.HTTPException):
            if condition():
                return
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)


def metric(running, family, model) -> float:
    text = running.request("GET", "/metrics")[2].decode()
    found = re.search(rf'{family}{{model="{model}",version="1"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def column(values) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [len(values), 1],
                                   "data": list(values)}]}).encode()


class Caller(threading.Thread):
    """One client on its own connection: sends ``value`` to ``model`` once connected, keeps the connection
    open until told to close, and records the answer or the error."""

    def __init__(self, running, model, value):
        super().__init__(daemon=True)
        self.running, self.model, self.value = running, model, value
        self.connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=DEADLINE)
        self.connection.connect()
        self.port = self.connection.sock.getsockname()[1]
        self.answer = self.error = None

    def run(self):
        try:
            self.connection.request("POST", f"/v2/models/{self.model}/infer", column([self.value]))
            response = self.connection.getresponse()
            self.answer = (response.status, json.loads(response.read()))
        except (OSError, http.client.HTTPException) as error:
            self.error = error

    def doubled(self) -> bool:
        return self.answer is not None and self.answer[0] == 200 and \
            self.answer[1]["outputs"][0]["data"] == [self.value * 2]


def batches(path, model) -> list[list[float]]:
    log = Path(f"{path}-{model}")
    return [[float(value) for value in line.split()] for line in log.read_text().splitlines()] if log.exists() else []


def test_64_callers_across_4_fronts_each_get_each_answer_once(workers):
    running, _, _ = workers
    pids = front_processes(running.process.pid)
    assert len(pids) == 4
    assert listening(running) == pids, "the server said ready (start_server waits for it) once every front listened"
    rounds, answers, errors = 20, {}, []
    ports, connected = {}, threading.Barrier(65)

    def caller(index):
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=DEADLINE)
        try:
            for step in range(rounds):
                row = [index, step, index + step, index * step]
                body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                               "data": row}]}).encode()
                connection.request("POST", "/v2/models/double/infer", body)
                response = connection.getresponse()
                answers[(index, step)] = (response.status, json.loads(response.read()), row)
            ports[index] = connection.sock.getsockname()[1]
        except Exception as error:
            errors.append(error)
        finally:
            connected.wait()  # the connections stay open until the main thread has seen which front holds each
            connection.close()

    before = json.loads(running.request("GET", "/v2/models/double/stats")[2])["model_stats"][0]
    threads = [threading.Thread(target=caller, args=(index,), daemon=True) for index in range(64)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(ports) + len(errors) == 64, "every caller done")
    held = owners(running, pids)
    connected.wait()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(answers) == 64 * rounds
    for status, body, row in answers.values():
        assert status == 200 and body["outputs"][0]["data"] == [2.0 * value for value in row]
    # the kernel spreads connections by a hash of their addresses: that one of 4 fronts gets none of 64 has a
    # chance of 4 x (3/4)^64, about 4e-8
    assert {held[port] for port in ports.values()} == set(pids), "the 64 connections went to all 4 fronts"
    after = json.loads(running.request("GET", "/v2/models/double/stats")[2])["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 64 * rounds, "each row ran once in the engine"
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 64 * rounds


def test_batches_hold_rows_from_several_fronts(workers):
    running, hold, log = workers
    hold.touch()
    callers = [Caller(running, "gated", float(index)) for index in range(1, 65)]
    for caller in callers:
        caller.start()
    # the first batch waits on the hold; every other row waits in the engine's queue, whichever front it came by
    wait_for(lambda: metric(running, "jitserve_queue_depth", "gated") >= 56, "56 rows queued in the engine")
    held = owners(running, front_processes(running.process.pid))
    front_of = {caller.value: held[caller.port] for caller in callers}
    hold.unlink()
    for caller in callers:
        caller.join()
    assert all(caller.doubled() for caller in callers)
    ran = batches(log, "gated")
    assert sorted(value for batch in ran for value in batch) == [float(index) for index in range(1, 65)], \
        "each row ran once"
    mixed = [batch for batch in ran if len({front_of[value] for value in batch}) > 1]
    assert mixed, f"some batch holds rows from several fronts: {ran} by front {front_of}"


@pytest.mark.parametrize("endpoint", ["infer_stream", "infer"])
def test_a_client_that_leaves_frees_its_queued_rows_in_the_engine(workers, endpoint):
    """A relayed stream, or an infer request decoded by the front: a client that leaves before its answer is
    told to the engine, whose rows of it leave the queue (its front's HTTP application cancels it)."""
    running, hold, log = workers
    hold.touch()
    before = len(batches(log, "gated1"))
    first = 101.0 if endpoint == "infer_stream" else 201.0
    sock = socket.create_connection(("127.0.0.1", running.port))
    body = column([first + index for index in range(8)])
    sock.sendall(b"POST /v2/models/gated1/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (endpoint.encode(), len(body), body))
    wait_for(lambda: metric(running, "jitserve_queue_depth", "gated1") == 7, "one row runs, seven wait")
    sock.close()
    wait_for(lambda: metric(running, "jitserve_queue_depth", "gated1") == 0, "the request's rows withdrawn")
    hold.unlink()
    wait_for(lambda: len(batches(log, "gated1")) == before + 1, "the held row ran")
    assert batches(log, "gated1")[before:] == [[first]], "only the row that had started ran"


def held_callers(running, hold) -> list[Caller]:
    """16 callers of gated1 (one row each) held in the engine: one row runs (held), fifteen wait."""
    hold.touch()
    callers = [Caller(running, "gated1", float(index)) for index in range(1, 17)]
    for caller in callers:
        caller.start()
    wait_for(lambda: metric(running, "jitserve_queue_depth", "gated1") == 15, "one row runs, fifteen wait")
    return callers


def test_a_killed_front_loses_only_its_own_requests_and_is_started_again(workers):
    running, hold, log = workers
    before = len(batches(log, "gated1"))
    pids = front_processes(running.process.pid)
    callers = held_callers(running, hold)
    held = owners(running, pids)
    by_front = {pid: [caller for caller in callers if held[caller.port] == pid] for pid in pids}
    victim = max(pids, key=lambda pid: len(by_front[pid]))
    lost = by_front[victim]
    os.kill(victim, signal.SIGKILL)
    # the engine cancels the requests the killed front held: their queued rows leave the queue
    wait_for(lambda: metric(running, "jitserve_queue_depth", "gated1") <= 16 - len(lost), "its rows withdrawn")
    wait_for(lambda: len(listening(running)) == 4 and victim not in listening(running), "the front started again")
    assert rings(running.process.pid) == 4, "the killed front's ring is unmapped in the engine, the new one mapped"
    hold.unlink()
    for caller in callers:
        caller.join()
    kept = [caller for caller in callers if caller not in lost]
    assert all(caller.doubled() for caller in kept), "the other fronts' requests are all answered"
    assert all(caller.answer is None and caller.error is not None for caller in lost), \
        "the killed front's clients lost their connections"
    ran = [value for batch in batches(log, "gated1")[before:] for value in batch]
    first = batches(log, "gated1")[before][0]
    assert set(ran) - {caller.value for caller in kept} <= {first}, \
        "of the killed front's requests, none ran but the one that had started before the kill"
    restarted = listening(running)
    connections = [http.client.HTTPConnection("127.0.0.1", running.port, timeout=DEADLINE) for _ in range(64)]
    for connection in connections:
        connection.request("POST", "/v2/models/double/infer", json.dumps(
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode())
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["outputs"][0]["data"] == [2, 4, 6, 8]
    served_by = set(owners(running, restarted).values())
    for connection in connections:
        connection.close()
    assert set(restarted) - set(pids) <= served_by, "the new front takes connections"


def test_sigterm_drains_every_front_and_the_engine(tmp_path):
    with gated_server(tmp_path, "--http-workers", "2") as (running, hold, log):
        pids = front_processes(running.process.pid)
        callers = held_callers(running, hold)
        running.process.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", running.port), timeout=5).close()
            except ConnectionRefusedError:
                return True
            return False

        wait_for(refused, "no front accepts connections any more")
        hold.unlink()  # the rows run only now that every front is draining
        for caller in callers:
            caller.join()
        assert all(caller.doubled() for caller in callers), "every request accepted before SIGTERM is answered"
        assert running.process.wait(timeout=DEADLINE) == 0
        running._reader.join(10)
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "no front process is left"
        assert sorted(value for batch in batches(log, "gated1") for value in batch) == \
            [float(index) for index in range(1, 17)]
        assert "Traceback" not in running.output()


def test_past_the_drain_timeout_a_front_answers_503_and_its_requests_leave_the_engine(tmp_path):
    with gated_server(tmp_path, "--http-workers", "2", "--drain-timeout", "1") as (running, hold, log):
        callers = held_callers(running, hold)
        running.process.send_signal(signal.SIGTERM)
        for caller in callers:  # the hold is not lifted: past the drain timeout the fronts give up on them
            caller.join()
        assert all(caller.answer[0] == 503 and "shut down before this request was answered" in
                   caller.answer[1]["error"] for caller in callers)
        wait_for(lambda: "SIGTERM: shutting down" in running.output(), "the fronts exited")
        hold.unlink()  # the one row that started may finish now
        assert running.process.wait(timeout=DEADLINE) == 0
        running._reader.join(10)
        assert len([value for batch in batches(log, "gated1") for value in batch]) == 1, "no queued row ran"
        stats = re.search(r"model 'gated1' drained and stopped: ServerStats\((.*)", running.output()).group(1)
        assert "cancelled=16," in stats and "stopped=0," in stats, \
            "all 16 cancelled by their fronts (the queued ones withdrawn), none refused by the engine's own drain"


def test_fronts_whose_engine_dies_answer_what_they_hold_503_and_exit(tmp_path):
    with gated_server(tmp_path, "--http-workers", "2") as (running, hold, _):
        pids = front_processes(running.process.pid)
        hold.touch()
        callers = [Caller(running, "gated1", float(index)) for index in (1, 2)]
        for caller in callers:
            caller.start()
        wait_for(lambda: metric(running, "jitserve_queue_depth", "gated1") == 1, "one row runs, one waits")
        running.process.kill()
        for caller in callers:
            caller.join()
        assert [caller.answer[0] for caller in callers] == [503, 503]
        assert all("engine process of this server exited" in caller.answer[1]["error"] for caller in callers)
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), "the fronts exited")


def binary_request(rows) -> tuple[bytes, dict]:
    """tritonclient's binary form of one FP32 input [rows, 4], asking for binary output."""
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 4],
                                     "parameters": {"binary_data_size": 16 * rows}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    data = np.arange(4 * rows, dtype=np.float32).tobytes()
    return header + data, {"Inference-Header-Content-Length": str(len(header))}


def text_request(texts) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}],
                       "outputs": [{"name": "text"}, {"name": "length"}]}).encode()


# what a client may send, each answered by one process and by the fronts: (method, path, body, headers)
EXCHANGES = [
    ("POST", "/v2/models/double/infer", json.dumps({"id": "a", "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4, 5, 6, 7, 8]}]}).encode(), {}),
    ("POST", "/v2/models/double/infer", *binary_request(1)),
    ("POST", "/v2/models/double/infer", *binary_request(5000)),  # larger than a slot: inline, both ways
    ("POST", "/v2/models/text/infer", text_request(["one", "three"]), {}),
    ("POST", "/v2/models/double/infer", b'{"inputs": [', {}),
    ("POST", "/v2/models/double/infer", column([1.0]), {}),
    ("POST", "/v2/models/double/infer", json.dumps({"inputs": [
        {"name": "input", "datatype": "INT8", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode(), {}),
    ("POST", "/v2/models/double/versions/7/infer", column([1.0]), {}),
    ("POST", "/v2/models/nosuch/infer", column([1.0]), {}),
    ("POST", "/v2/models/picky/infer", column([-1.0]), {"X-Request-ID": "failing-1"}),
    ("POST", "/v2/models/picky/infer", column([422.0]), {}),
    ("POST", "/v2/models/picky/infer", column([1.0, 2.0]), {}),
    ("POST", "/v2/models/picky/infer", json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1],
                                                   "data": [1]}], "parameters": {"sequence_id": 3}}).encode(), {}),
    ("POST", "/v2/models/steps/infer", column([1.0]), {}),
    ("POST", "/v2/models/steps/infer_stream", column([5.0]), {}),
    ("GET", "/v2/models/double", None, {}),
    ("GET", "/v2/models/double/config", None, {}),
    ("GET", "/v2/models/nosuch/ready", None, {}),
    ("GET", "/v2/health/ready", None, {}),
    ("POST", "/v2/repository/index", b"", {}),
    ("POST", "/v2/repository/models/double/unload", b"", {}),
    ("GET", "/v2/nowhere", None, {}),
    ("PUT", "/v2/models/double/infer", b"", {}),
]


def requests_counted(running) -> dict[tuple[str, ...], float]:
    """jitserve_requests_total by its labels, from /metrics."""
    text = running.request("GET", "/metrics")[2].decode()
    return {tuple(sample.labels[label] for label in ("model", "version", "protocol", "status")): sample.value
            for family in text_string_to_metric_families(text) if family.name == "jitserve_requests"
            for sample in family.samples if sample.name == "jitserve_requests_total"}


def test_the_fronts_answer_as_one_process_does_and_count_every_answer(workers, tmp_path):
    running, _, _ = workers
    with gated_server(tmp_path) as (single, _, _):
        counted = {server: requests_counted(server) for server in (single, running)}
        for method, path, body, headers in EXCHANGES:
            one = single.request(method, path, body, headers)
            each = running.request(method, path, body, headers)
            assert (each[0], each[1].get("Content-Type"), each[2]) == (one[0], one[1].get("Content-Type"), one[2]), \
                f"{method} {path}"
        for server in (single, running):
            status, _, answer = server.request("POST", "/v2/models/picky/infer", column([-1.0]), {"X-Request-ID": "x-1"})
            assert status == 500 and b"request id x-1" in answer
        assert "[request x-1]" in running.output() and "ValueError: negative rows" in running.output(), \
            "the model's failure is logged by the engine, with its traceback, under the front's request id"
        counted = {server: {labels: value - counted[server].get(labels, 0.0)
                            for labels, value in requests_counted(server).items()
                            if value != counted[server].get(labels, 0.0)} for server in (single, running)}
        assert counted[running] == counted[single], "every answer counted in the engine, as one process counts"
        scrapes = {json.dumps(sorted(requests_counted(running).items())) for _ in range(8)}
        assert len(scrapes) == 1, "any front's /metrics is the engine's"


def test_grpc_and_tritonclient_reach_the_same_engine(workers):
    running, _, _ = workers
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for module, url in ((httpclient, f"127.0.0.1:{running.port}"), (grpcclient, f"127.0.0.1:{running.grpc_port}")):
        client = module.InferenceServerClient(url)
        tensor = module.InferInput("input", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        assert client.infer("double", [tensor]).as_numpy("output").tolist() == (x * 2).tolist()
        assert client.is_model_ready("double")
        client.close()


DOUBLER = """
import jitserve as js

serving = js.Serving(lambda x: x * {factor}, batch_size=4, batch_timeout=0.001,
                     input_template=js.template((4,), "float32"))
"""


def test_the_model_repository_loads_and_unloads_through_any_front(tmp_path):
    for name, factor in (("doubler", 2), ("tripler", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_text(DOUBLER.format(factor=factor))
    running = start_server(f"--model-repository={tmp_path}", "--model-control-mode", "explicit", "--load-model",
                           "doubler", "--http-workers", "2")
    x = np.ones((1, 4), np.float32)

    def infer(model):  # a new connection each time: any front may take it
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
        tensor = httpclient.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(x)
        try:
            return client.infer(model, [tensor]).as_numpy("output").tolist()
        finally:
            client.close()

    try:
        control = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
        assert infer("doubler") == [[2.0] * 4]
        with pytest.raises(Exception, match="unknown model 'tripler'"):
            infer("tripler")
        control.load_model("tripler")
        assert all(infer("tripler") == [[3.0] * 4] for _ in range(8)), "loaded through one front, served by all"
        control.unload_model("doubler")
        for _ in range(8):
            with pytest.raises(Exception, match="unknown model 'doubler'"):
                infer("doubler")
        index = {entry["name"]: entry["state"] for entry in control.get_model_repository_index()}
        assert index == {"doubler": "UNAVAILABLE", "tripler": "READY"}
        control.close()
    finally:
        assert "Traceback" not in stop(running)


def test_the_fronts_keep_tls_and_the_api_key(certificate):
    cert, key = certificate
    running = start_server(MODELS, "--http-workers", "2", "--tls-cert", str(cert), "--tls-key", str(key),
                           "--api-key", "sesame", "--cors-origin", "https://app.example", tls_ca=str(cert))
    try:
        for path, body in (("/v2/models/double/infer", json.dumps({"inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode()),
                           ("/v2/models/double", None)):  # decoded by a front; relayed to the engine
            method = "GET" if body is None else "POST"
            status, _, answer = running.request(method, path, body)
            assert status == 401 and b"needs an API key" in answer
            status, headers, answer = running.request(method, path, body, {"Authorization": "Bearer sesame",
                                                                           "Origin": "https://app.example"})
            assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        assert json.loads(answer)["name"] == "double"
    finally:
        assert "Traceback" not in stop(running)


def test_a_count_of_fronts_that_is_no_count_is_refused_in_one_line(capsys):
    from jitserve.cli import main

    assert main(["serve", f"{ROOT / 'examples' / 'mlp.py'}:serving", "--http-workers", "0", "--no-grpc"]) == 2
    assert "--http-workers must be a count of front processes from 1 to 256, got 0" in capsys.readouterr().err


def test_every_datatype_crosses_the_ring_as_it_was_and_frames_survive_any_split():
    import ml_dtypes

    from jitserve.protocol.workers.ring import HEAD, Frames, Message, Ring, read_message

    tensors = [("bool", np.array([[True, False]])), ("u8", np.arange(6, dtype=np.uint8).reshape(2, 3)),
               ("i64", np.array(-3, np.int64)), ("f16", np.zeros((0, 4), np.float16)),
               ("bf16", np.array([1.5, -2.0], ml_dtypes.bfloat16)), ("f64", np.linspace(0, 1, 5)[::2]),
               ("text", np.array([[b"caf\xc3\xa9", b""]], dtype=object))]
    ring = Ring.create()
    message = Message({"m": "model", "n": 3}, tensors)
    message.write(ring.slot(5))
    for view in (ring.slot(5), bytes(message.inline())):
        header, read = read_message(view)
        assert header == {"m": "model", "n": 3}
        for (name, sent), (named, got) in zip(tensors, read, strict=True):
            assert named == name and got.dtype == sent.dtype and got.shape == sent.shape
            assert got.tolist() == sent.tolist()
    stream = b"".join(HEAD.pack(kind, kind * 7, kind - 1, len(payload)) + payload
                      for kind, payload in ((1, b""), (2, b"x" * 70_000), (3, b"abc")))
    frames, parts = Frames(), []
    for at in range(0, len(stream), 4099):
        parts += frames.feed(stream[at:at + 4099])
    assert parts == [(1, 7, 0, b""), (2, 14, 1, b"x" * 70_000), (3, 21, 2, b"abc")]


def test_a_fronts_ring_is_unmapped_once_its_connection_closes_without_waiting_for_a_collection():
    """Issue 56: the engine's end of a SIGKILLed front held its 8 MiB ring until the cyclic garbage collector
    freed the link (a cycle through its handlers), one ring more per restart. The collector is off here."""
    from jitserve.protocol.workers.engine import FrontLink
    from jitserve.protocol.workers.ring import Ring

    async def lost() -> int:
        ours, theirs = socket.socketpair()
        _, link = await asyncio.get_running_loop().connect_accepted_socket(
            lambda: FrontLink(0, SimpleNamespace(pid=0), Ring.create(), None, None, lambda _: None), ours)
        mapped = rings()
        theirs.close()  # as a killed front's end closes
        await link.closed
        return mapped

    before = rings()
    gc.disable()
    try:
        assert asyncio.run(lost()) == before + 1
        assert rings() == before
    finally:
        gc.enable()
