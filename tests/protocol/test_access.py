"""Opt-in access control on the real `jitserve serve`: an API key on HTTP and gRPC, TLS on both (a self-signed
certificate made by the test with openssl), CORS, HEAD and OPTIONS, and gzip bodies both ways.

The CORS preflight is sent here as raw requests, the way a browser sends it; test_browser.py has a real
headless Chromium do it."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

pytest.importorskip("uvicorn")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import ROOT, start_server, stop  # noqa: E402

KEY = "s3cret-key"
ORIGIN = "http://app.example.test"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(certificate):
    cert, key = certificate
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--name", "mlp", "--api-key", KEY,
                           "--tls-cert", str(cert), "--tls-key", str(key), "--cors-origin", ORIGIN,
                           tls_ca=str(cert))
    yield running
    output = stop(running)
    assert "https://127.0.0.1" in output and "API key required" in output and "gRPC over TLS" in output
    assert KEY not in output, "the key is never logged"


HTTPS_CLIENT = """
import ssl, sys, json
import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
port, cert, key = sys.argv[1:]
client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", ssl=True,
                                          ssl_context_factory=lambda: ssl.create_default_context(cafile=cert))
tensor = httpclient.InferInput("input", [1, 16], "FP32")
tensor.set_data_from_numpy(np.full((1, 16), 0.5, np.float32))
print(json.dumps(client.infer("mlp", [tensor], headers={"Authorization": f"Bearer {key}"}).as_numpy("output").tolist()))
try:
    client.infer("mlp", [tensor])
    print("accepted")
except InferenceServerException as error:
    print(error.status())
"""


def infer_body(rows: int = 1) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 16],
                                   "data": [0.5] * 16 * rows}]}).encode()


def test_http_needs_the_key_except_for_health(server):
    assert server.request("GET", "/v2/health/ready")[0] == 200, "probes need no key"
    status, headers, body = server.request("POST", "/v2/models/mlp/infer", infer_body())
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"] == "this server needs an API key: send the header 'Authorization: Bearer <key>'"
    assert server.request("POST", "/v2/models/mlp/infer", infer_body(), {"Authorization": "Bearer wrong"})[0] == 401
    assert server.request("GET", "/v2/models/mlp")[0] == 401
    assert server.request("POST", "/v2/models/mlp/infer", infer_body(), BEARER)[0] == 200
    assert server.request("POST", "/v2/models/mlp/infer", infer_body(), {"X-API-Key": KEY})[0] == 200


def test_tritonclient_over_https_and_grpc_tls_with_the_key(server, certificate):
    cert, _ = certificate
    x = np.full((1, 16), 0.5, np.float32)
    # tritonclient's HTTPS client (geventhttpclient) changes how this process's ssl sockets behave, which
    # would cut the raw requests of the other tests: it runs in a process of its own
    client = subprocess.run([sys.executable, "-c", HTTPS_CLIENT, str(server.port), str(cert), KEY],
                            capture_output=True, text=True, timeout=120)
    assert client.returncode == 0, client.stderr
    answer, refused_status = client.stdout.strip().splitlines()
    expected = np.array(json.loads(answer), np.float32)
    assert expected.shape == (1, 4) and np.isclose(expected.sum(), 1.0)
    assert refused_status == "401"

    secure = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}", ssl=True,
                                              root_certificates=str(cert))
    tensor = grpcclient.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_allclose(secure.infer("mlp", [tensor], headers={"authorization": f"Bearer {KEY}"})
                               .as_numpy("output"), expected, rtol=1e-6)
    with pytest.raises(InferenceServerException) as refused:
        secure.infer("mlp", [tensor])
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "Authorization: Bearer" in refused.value.message()
    assert secure.is_server_live() and secure.is_server_ready(), "KServe's own health calls are open, as HTTP's"
    with pytest.raises(InferenceServerException) as refused:
        secure.get_model_metadata("mlp")
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"


def test_grpc_health_needs_no_key_and_plaintext_is_refused(server, certificate):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cert, _ = certificate
    channel = grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", grpc.ssl_channel_credentials(cert.read_bytes()))
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    plain = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()


def test_cors_preflight_head_and_options(server):
    status, headers, body = server.request("OPTIONS", "/v2/models/mlp/infer", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and body == b""
    assert headers["access-control-allow-origin"] == ORIGIN
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = server.request("OPTIONS", "/v2/models/mlp/infer", headers={"Origin": "http://evil.test"})
    assert status == 204 and "access-control-allow-origin" not in headers, "an origin not admitted gets no CORS"
    status, headers, _ = server.request("POST", "/v2/models/mlp/infer", infer_body(), {**BEARER, "Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, body = server.request("HEAD", "/v2/health/ready")
    assert status == 200 and body == b"" and headers["content-length"] == str(len(b'{"ready":true}'))


def test_gzip_request_and_response_bodies(server):
    body = infer_body(rows=32)
    status, headers, data = server.request("POST", "/v2/models/mlp/infer", gzip.compress(body), {
        **BEARER, "Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    plain_status, _, plain = server.request("POST", "/v2/models/mlp/infer", body, BEARER)
    assert plain_status == 200 and json.loads(gzip.decompress(data)) == json.loads(plain)
    bomb = gzip.compress(b" " * (80 * 2**20))  # 80 MiB of spaces in 80 KiB: over the 64 MiB limit once inflated
    status, _, data = server.request("POST", "/v2/models/mlp/infer", bomb, {**BEARER, "Content-Encoding": "gzip"})
    assert status == 413 and "exceeds the limit" in json.loads(data)["error"]
    status, _, data = server.request("POST", "/v2/models/mlp/infer", body, {**BEARER, "Content-Encoding": "br"})
    assert status == 400 and "Content-Encoding 'br' is not supported" in json.loads(data)["error"]
    assert server.request("POST", "/v2/models/mlp/infer", infer_body(), BEARER)[0] == 200
