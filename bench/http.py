"""jitserve over HTTP against LitServe serving the same function, same max batch size and timeout.

In one run: start ``jitserve serve`` (HTTP only) and a LitServe server as subprocesses on
loopback, each serving the MLP below (256 -> 1024 -> 256, float32, jitted with XLA) with
``max_batch_size`` 64 and ``batch_timeout`` 2 ms; then N concurrent closed-loop callers for a
fixed time against each:

- jitserve with tritonclient.http (binary tensors, as tritonclient sends by default);
- jitserve with a plain keep-alive HTTP client and JSON tensors;
- LitServe with the same plain keep-alive HTTP client and JSON (LitServe has no KServe v2
  endpoint, so tritonclient cannot call it).

Prints rows/s and p50/p99 latency for each, and jitserve's throughput over LitServe's.
Goal: jitserve >= 2x LitServe's throughput at an equal or better p99.
Needs ``pip install 'jitserve[bench]'`` for LitServe.

    python3 dev.py bench http
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jitserve as js
from jitserve.loadtest import closed_loop

BATCH, TIMEOUT, FEATURES = 64, 0.002, 256
rng = np.random.default_rng(0)
W1 = rng.normal(0, 0.05, (FEATURES, 1024)).astype(np.float32)
W2 = rng.normal(0, 0.05, (1024, FEATURES)).astype(np.float32)


def mlp(x):
    return jnp.maximum(x @ W1, 0.0) @ W2


serving = js.Serving(mlp, batch_size=BATCH, batch_timeout=TIMEOUT, input_template=js.template((FEATURES,), "float32"))


try:
    import litserve as ls
except ImportError:  # a bench-only extra: the LitServe row is skipped without it
    ls = None

if ls is not None:
    class LitMLP(ls.LitAPI):
        """The same MLP for LitServe (module level: LitServe pickles it into its worker process)."""

        def setup(self, device):
            self.fn = jax.jit(mlp)

        def decode_request(self, request):
            return np.asarray(request["input"], np.float32)

        def batch(self, inputs):
            return np.stack(inputs)

        def predict(self, x):
            return np.asarray(self.fn(x))

        def unbatch(self, output):
            return list(output)

        def encode_response(self, output):
            return {"output": output.tolist()}


def litserve_main(port: int) -> None:
    server = ls.LitServer(LitMLP(max_batch_size=BATCH, batch_timeout=TIMEOUT), accelerator="cpu",
                          workers_per_device=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, path: str, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server on port {port} exited: {process.stdout.read() if process.stdout else ''}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", path)
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"server on port {port} not ready in {seconds} s")


def tritonclient_caller(port: int):
    import tritonclient.http as httpclient

    def make(seed: int):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.random.default_rng(seed).normal(size=(1, FEATURES)).astype(np.float32)
        tensor = httpclient.InferInput("input", [1, FEATURES], "FP32")
        tensor.set_data_from_numpy(x)

        def call() -> int:
            assert client.infer("mlp", [tensor]).as_numpy("output").shape == (1, FEATURES)
            return 1
        return call
    return make


def json_caller(port: int, path: str, body_of):
    def make(seed: int):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        x = np.random.default_rng(seed).normal(size=(FEATURES,)).astype(np.float32)
        body = json.dumps(body_of(x)).encode()

        def call() -> int:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            assert response.status == 200, data
            return 1
        return call
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--litserve-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.litserve_server:
        litserve_main(args.litserve_server)
        return

    here = Path(__file__).resolve()
    ours_port, lit_port = free_port(), free_port()
    ours = subprocess.Popen([sys.executable, "-m", "jitserve", "serve", f"{here}:serving", "--name", "mlp",
                             "--port", str(ours_port), "--no-grpc"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    results = {}
    try:
        wait_ready(ours_port, "/v2/health/ready", ours)
        results["jitserve, tritonclient.http (binary)"] = closed_loop(tritonclient_caller(ours_port), args.callers,
                                                                       args.seconds)
        results["jitserve, plain HTTP + JSON"] = closed_loop(json_caller(
            ours_port, "/v2/models/mlp/infer",
            lambda x: {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, FEATURES], "data": x.tolist()}]}),
            args.callers, args.seconds)
    finally:
        ours.terminate()
        ours.wait(60)
    litserve_result = None
    if ls is not None:
        lit = subprocess.Popen([sys.executable, "-P", str(here), "--litserve-server", str(lit_port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(lit_port, "/health", lit)
            litserve_result = closed_loop(json_caller(lit_port, "/predict", lambda x: {"input": x.tolist()}),
                                          args.callers, args.seconds)
        finally:
            lit.terminate()
            lit.wait(60)

    print(f"MLP {FEATURES}->1024->{FEATURES} float32 (XLA), max batch {BATCH}, batch timeout {TIMEOUT * 1e3:g} ms, "
          f"{args.callers} closed-loop callers x {args.seconds:g} s, 1 row per request, loopback")
    print("| server, client | requests/s | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    rows = list(results.items()) + ([("LitServe, plain HTTP + JSON", litserve_result)] if litserve_result else [])
    for label, load in rows:
        print(f"| {label} | {load.rows_per_s:,.0f} | {load.percentile(50) * 1e3:.2f} | {load.percentile(99) * 1e3:.2f} |")
    if litserve_result is None:
        print("LitServe not installed: pip install 'jitserve[bench]'")
        return
    for label, load in results.items():
        print(f"{label}: {load.rows_per_s / litserve_result.rows_per_s:.2f}x LitServe's throughput, "
              f"p99 {load.percentile(99) * 1e3:.1f} ms vs {litserve_result.percentile(99) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
