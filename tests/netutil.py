"""What tests that start servers share: a free loopback port, and waiting for a server to be ready."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
