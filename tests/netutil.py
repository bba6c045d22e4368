"""What tests that start servers share: a free loopback port, waiting for a server to be ready, and a
``jitserve serve`` process to drive and stop."""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from jitserve.defaults import CACHE_DIR_ENV

ROOT = Path(__file__).resolve().parents[1]
# perf_analyzer, Triton's benchmark (genai-perf drives it): tritonclient 2.51.0's binary and the CUDA runtime it
# links (no GPU needed), which python3 dev.py test installs beside the environment
PERF_ANALYZER = Path(sys.prefix) / "perf-analyzer"


def perf_analyzer_environment() -> dict[str, str]:
    """This process's environment with perf_analyzer on PATH and its CUDA runtime on LD_LIBRARY_PATH; the
    test fails, never skips, where python3 dev.py test has not installed it."""
    binary = PERF_ANALYZER / "bin" / "perf_analyzer"
    assert binary.exists(), f"no perf_analyzer at {binary}: python3 dev.py test installs it (tritonclient 2.51.0's)"
    runtime = PERF_ANALYZER / "nvidia" / "cuda_runtime" / "lib"
    return {**os.environ, "PATH": f"{binary.parent}:{os.environ.get('PATH', '')}",
            "LD_LIBRARY_PATH": f"{runtime}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


# the compile cache every server this run starts shares, as jitserve serve keeps one by default (not the user's)
COMPILE_CACHE = tempfile.mkdtemp(prefix="jitserve-compile-cache-")
atexit.register(shutil.rmtree, COMPILE_CACHE, True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_front(config):
    """A uvicorn server of ``config`` (``jitserve.protocol.app.http_config``'s) on a thread of this process,
    once it has started; stopped at the end."""
    import uvicorn

    front = uvicorn.Server(config)
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not front.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the HTTP front did not start"
        time.sleep(0.05)
    try:
        yield front
    finally:
        front.should_exit = True
        thread.join(30)


def front_processes(server_pid: int) -> list[int]:
    """The pids of a ``jitserve serve --http-workers N`` (or ``front``) process's HTTP front processes: its
    children running the front module."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server_pid and b"jitserve.protocol.workers.front" in command:
            found.append(int(entry))
    return sorted(found)


def wait_ready(port: int, process: subprocess.Popen, seconds: float) -> None:
    """Poll ``/v2/health/ready`` until it answers 200; fail with the process's output if it exits first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, (process.stdout or process.stderr).read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the server on port {port} did not become ready in {seconds} s")


class Running:
    """A ``jitserve serve`` process on loopback ports, with plain-HTTP helpers."""

    def __init__(self, process: subprocess.Popen, port: int, grpc_port: int, tls_ca: str | None = None) -> None:
        self.process, self.port, self.grpc_port = process, port, grpc_port
        self.tls = None if tls_ca is None else ssl.create_default_context(cafile=tls_ca)
        self.lines: list[str] = []  # its output so far: read as it comes, so a full pipe never blocks its logging
        self._reader = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self._reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 30) -> tuple[int, dict, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout) if self.tls is None else \
            http.client.HTTPSConnection("127.0.0.1", self.port, timeout=timeout, context=self.tls)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def infer_json(self, model: str, payload, timeout: float = 30) -> tuple[int, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, _, data = self.request("POST", f"/v2/models/{model}/infer", body, timeout=timeout)
        return status, json.loads(data)

    def queued_rows(self, model: str, version: str = "1") -> float:
        """The rows of ``model`` waiting in the server's queue now, as its metrics say."""
        metrics = self.request("GET", "/metrics")[2].decode()
        found = re.search(rf'jitserve_queue_depth\{{model="{model}",version="{version}"\}} (\S+)', metrics)
        assert found is not None, f"no queue depth of {model} {version} in the metrics"
        return float(found.group(1))

    def assert_healthy(self) -> None:
        status, _, _ = self.request("GET", "/v2/health/live")
        assert status == 200
        assert self.process.poll() is None


def start_server(target: str, *extra: str, tls_ca: str | None = None, open_files: int | None = None,
                 env: dict[str, str] | None = None) -> Running:
    """``jitserve serve target`` on two free ports with ``extra`` flags, once it reports ready (over HTTPS,
    trusting ``tls_ca``, when given; allowed ``open_files`` descriptors, soft and hard, when given; with
    ``env`` added to this process's environment, when given)."""
    port, grpc_port = free_port(), free_port()

    def limit_files() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    # no preexec_fn unless a limit needs one: Python then starts the server with vfork, which runs no fork
    # handlers; gRPC's (this process has tritonclient channels) made a fork wait for ever or left the child
    # a broken poller ("epoll_wait error: Bad file descriptor", the server gone at start)
    process = subprocess.Popen(
        [sys.executable, "-m", "jitserve", "serve", target, "--port", str(port), "--grpc-port", str(grpc_port),
         *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=None if open_files is None else limit_files, env={**os.environ, CACHE_DIR_ENV: COMPILE_CACHE, **(env or {})})
    running = Running(process, port, grpc_port, tls_ca)
    deadline = time.monotonic() + 300  # a bound for a server that never starts; a busy CI machine compiles slowly
    while time.monotonic() < deadline:
        if process.poll() is not None:
            running._reader.join(10)
            raise AssertionError(f"jitserve serve exited early:\n{running.output()}")
        try:
            if running.request("GET", "/v2/health/ready", timeout=2)[0] == 200:
                return running
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("jitserve serve did not become ready in 300 s")


@contextlib.contextmanager
def serving(target: str, *extra: str):
    """``start_server`` for a ``with`` block (a module's server fixture), stopped after it; its log must show
    no traceback."""
    running = start_server(target, *extra)
    yield running
    assert "Traceback" not in stop(running)


def stop(running: Running) -> str:
    """SIGTERM, and the output once it exited 0."""
    running.process.send_signal(signal.SIGTERM)
    running.process.wait(timeout=60)
    running._reader.join(10)
    output = running.output()
    assert running.process.returncode == 0, output
    return output
