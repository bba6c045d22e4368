"""`jitserve serve --log-format json`: every line of the log (jitserve's and uvicorn's) is one JSON object, and
the lines a request causes carry its request id, the client's own when it sends one."""

from __future__ import annotations

import datetime
import json
import re

import numpy as np
import pytest

pytest.importorskip("uvicorn")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import ROOT, start_server, stop  # noqa: E402

BAD_INPUT = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]})


def test_json_logs_parse_line_by_line_and_carry_request_ids():
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--log-format", "json")
    try:
        status, headers, _ = running.request("POST", "/v2/models/mlp/infer", BAD_INPUT.encode(),
                                             {"X-Request-ID": "client-42"})
        assert status == 400 and headers["x-request-id"] == "client-42"
        _, headers, _ = running.request("GET", "/v2/health/ready")
        assert re.fullmatch(r"[0-9a-f]{16}", headers["x-request-id"]), "a request without an id gets one"
        _, headers, _ = running.request("GET", "/v2/health/ready", headers={"X-Request-ID": "bad id, with spaces"})
        assert re.fullmatch(r"[0-9a-f]{16}", headers["x-request-id"]), "an id that is no plain token is replaced"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        tensor = grpcclient.InferInput("input", [1, 3], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("mlp", [tensor], headers={"x-request-id": "grpc-7"})
    finally:
        output = stop(running)
    lines = [json.loads(line) for line in output.splitlines()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert all(datetime.datetime.fromisoformat(line["time"]).utcoffset() == datetime.timedelta(0) for line in lines)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line["time"]) for line in lines)
    by_id = {line.get("request_id"): line for line in lines if line["level"] == "WARNING"}
    assert "expects [-1, 16]" in by_id["client-42"]["message"] and by_id["client-42"]["logger"] == "jitserve.serve"
    assert by_id["grpc-7"]["message"].startswith("grpc: model 'mlp': INVALID_ARGUMENT")
    assert any(line["message"].startswith("HTTP: http://127.0.0.1") for line in lines)


MLP_INPUT = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 16], "data": [0.5] * 48}]})


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_access_log_has_one_line_per_inference_request(log_format):
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--access-log", "--log-format", log_format)
    try:
        assert running.request("POST", "/v2/models/mlp/infer", MLP_INPUT.encode(), {"X-Request-ID": "ok-1"})[0] == 200
        assert running.request("POST", "/v2/models/mlp/infer", BAD_INPUT.encode(), {"X-Request-ID": "bad-2"})[0] == 400
        assert running.request("GET", "/v2/health/ready")[0] == 200  # not an inference request: not logged
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        tensor = grpcclient.InferInput("input", [2, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
        client.infer("mlp", [tensor], headers={"x-request-id": "grpc-3"})
    finally:
        output = stop(running)
    if log_format == "json":
        lines = [json.loads(line) for line in output.splitlines()]
        access = [line for line in lines if line["logger"] == "jitserve.access"]
        assert [{k: line[k] for k in ("request_id", "model", "version", "protocol", "status", "rows")}
                for line in access] == [
            {"request_id": "ok-1", "model": "mlp", "version": "1", "protocol": "http", "status": 200, "rows": 3},
            {"request_id": "bad-2", "model": "mlp", "version": "1", "protocol": "http", "status": 400, "rows": 1},
            {"request_id": "grpc-3", "model": "mlp", "version": "1", "protocol": "grpc", "status": "OK", "rows": 2}]
        assert all(line["latency_ms"] > 0 and line["level"] == "INFO" for line in access)
        return
    access = [line for line in output.splitlines() if " jitserve.access: " in line]
    assert len(access) == 3
    assert re.search(r" INFO jitserve\.access: http mlp/1 200 rows=3 \d+\.\d{3}ms \[request ok-1\]$", access[0])
    assert re.search(r" INFO jitserve\.access: http mlp/1 400 rows=1 \d+\.\d{3}ms \[request bad-2\]$", access[1])
    assert re.search(r" INFO jitserve\.access: grpc mlp/1 OK rows=2 \d+\.\d{3}ms \[request grpc-3\]$", access[2])


def test_a_client_repeating_a_mistake_cannot_flood_the_log():
    """200 requests to an unknown model: the first three are WARNING lines, then the 10th and the 100th
    (counting them); the others are DEBUG lines, below the server's level. Each is still a 404 and counted
    in /metrics; a new kind of mistake is a WARNING line again."""
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving")
    try:
        for _ in range(200):
            assert running.request("POST", "/v2/models/nope/infer", MLP_INPUT.encode())[0] == 404
        for name in ("other", "another"):  # another name is the same kind of mistake
            assert running.request("POST", f"/v2/models/{name}/infer", MLP_INPUT.encode())[0] == 404
        assert running.request("POST", "/v2/models/mlp/infer", BAD_INPUT.encode())[0] == 400
        metrics = running.request("GET", "/metrics")[2].decode()
    finally:
        output = stop(running)
    assert re.search(r'jitserve_requests_total\{model="",protocol="http",status="404",version=""\} 202\.0', metrics)
    warnings = [line for line in output.splitlines() if " WARNING " in line]
    assert len(warnings) == 6, warnings
    assert all("404: unknown model 'nope'" in line for line in warnings[:5])
    assert warnings[3].endswith("(10 answers of this kind so far; after the first 3, each is a DEBUG line but "
                                "the 10th, 100th, 1,000th...)" + warnings[3][warnings[3].index(" [request"):])
    assert "(100 answers of this kind so far;" in warnings[4]
    assert "model 'mlp': 400: input 'input' has shape [1, 3], but model 'mlp' expects [-1, 16]" in warnings[5]
