"""Fixtures the network tests share."""

import importlib
import shutil
import subprocess

import pytest


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate and its key for 127.0.0.1, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(params=["http", "grpc"])
def triton(request, server):
    """(tritonclient.http or tritonclient.grpc, a client of it on the test module's ``server``)."""
    module = importlib.import_module(f"tritonclient.{request.param}")
    client = module.InferenceServerClient(f"127.0.0.1:{server.port if request.param == 'http' else server.grpc_port}")
    yield module, client
    client.close()
