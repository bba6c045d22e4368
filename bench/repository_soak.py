"""A soak of a model repository under load: a model that misbehaves, reloaded every second over HTTP and
gRPC, while 8 callers infer another model.

``jitserve serve --model-repository DIR --model-control-mode explicit --drain-timeout 2 --model-load-timeout 3``
serves two models:
``steady`` (doubles 4 floats) and ``flaky``, whose ``model.py`` is rewritten before each reload to do, in
turn, one of: ``sys.exit(3)``, hang (a load that never returns), ``raise RuntimeError``, and succeed. For
``--seconds`` (60) seconds, one reload a second (alternating HTTP and gRPC) while 8 HTTP callers infer
``steady``. It prints the answers by kind, the reloads by outcome, ``flaky``'s states seen in the index, the
server's resident memory and open descriptors at the start, at the peak and after the soak, and how long
SIGTERM took to end the server; it exits 1 if any ``steady`` request failed, if ``flaky``'s state stayed
``LOADING`` past the end, if memory or descriptors did not come back (within 64 MiB and 16 descriptors of
the start, hung loads' threads aside), or if SIGTERM took longer than the drain timeout and 10 s. Loopback
only; bounded in count and time.

    python3 dev.py bench repository_soak [--seconds 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[1]
STEADY = """
import jitserve as js

serving = js.Serving(lambda x: x * 2, batch_size=4, batch_timeout=0.001, input_template=js.template((4,), "float32"))
"""
FLAKY = {
    "exits": "import sys\nsys.exit(3)\n",
    "hangs": "import threading\nthreading.Event().wait()\n",
    "raises": "raise RuntimeError('flaky model: this load fails')\n",
    "succeeds": STEADY,
}
DRAIN_S = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def usage(pid: int) -> tuple[int, int]:
    """Resident memory (bytes) and open descriptors of ``pid``."""
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def post(port: int, path: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def caller(port: int, stop: threading.Event, outcomes: collections.Counter) -> None:
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    while not stop.is_set():
        try:
            status, answer = post(port, "/v2/models/steady/infer", body)
            right = status == 200 and answer["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
            outcomes["steady 200" if right else f"steady {status} {answer.get('error', '')[:60]}"] += 1
        except OSError as error:
            outcomes[f"steady {type(error).__name__}"] += 1


def reload(port: int, grpc_port: int, use_grpc: bool) -> str:
    """One load of ``flaky``: its outcome, in a few words."""
    if use_grpc:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            client.load_model("flaky", client_timeout=1.0)
            return "grpc ok"
        except Exception as error:  # the outcome is what is counted
            return f"grpc {str(error).split(':')[0][:40]}"
        finally:
            client.close()
    try:
        status, _ = post(port, "/v2/repository/models/flaky/load", {}, timeout=1.0)
        return f"http {status}"
    except OSError:
        return "http no answer within 1 s (a hanging load)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder)
        for name, source in (("steady", STEADY), ("flaky", FLAKY["succeeds"])):
            (repository / name).mkdir()
            (repository / name / "model.py").write_text(source)
        port, grpc_port = free_port(), free_port()
        server = subprocess.Popen([sys.executable, "-m", "jitserve", "serve", f"--model-repository={repository}",
                                   "--model-control-mode", "explicit", "--load-model", "steady", "--port", str(port),
                                   "--grpc-port", str(grpc_port), "--drain-timeout", str(DRAIN_S),
                                   "--model-load-timeout", "3"],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        start_usage = peak = usage(server.pid)
        outcomes: collections.Counter = collections.Counter()
        reloads: collections.Counter = collections.Counter()
        states: collections.Counter = collections.Counter()
        stop = threading.Event()
        callers = [threading.Thread(target=caller, args=(port, stop, outcomes)) for _ in range(8)]
        for thread in callers:
            thread.start()
        kinds = list(FLAKY)
        began = time.monotonic()
        turn = 0
        while time.monotonic() - began < args.seconds:
            kind = kinds[turn % len(kinds)]
            (repository / "flaky" / "model.py").write_text(FLAKY[kind])
            reloads[f"{kind}: {reload(port, grpc_port, turn % 2 == 1)}"] += 1
            index = post(port, "/v2/repository/index", {})[1]
            states.update(entry["state"] for entry in index if entry["name"] == "flaky")
            used = usage(server.pid)
            peak = (max(peak[0], used[0]), max(peak[1], used[1]))
            turn += 1
            time.sleep(max(0.0, began + turn - time.monotonic()))
        stop.set()
        for thread in callers:
            thread.join(30)
        time.sleep(5)
        end_usage = usage(server.pid)
        final_state = next(e["state"] for e in post(port, "/v2/repository/index", {})[1] if e["name"] == "flaky")
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(DRAIN_S + 10)
            exit_s = time.monotonic() - signalled
        except subprocess.TimeoutExpired:
            server.kill()
            exit_s = float("inf")
    print(f"# {args.seconds:.0f} s, {turn} reloads of 'flaky' (exits, hangs, raises, succeeds in turn; HTTP and "
          f"gRPC alternately), 8 HTTP callers of 'steady'")
    for name, table in (("steady answers", outcomes), ("flaky reloads", reloads), ("flaky states seen", states)):
        print(f"{name}: " + ", ".join(f"{key} x{count}" for key, count in sorted(table.items())))
    mib = 2**20
    print(f"memory MiB start {start_usage[0] / mib:.0f}, peak {peak[0] / mib:.0f}, after {end_usage[0] / mib:.0f}; "
          f"descriptors start {start_usage[1]}, peak {peak[1]}, after {end_usage[1]}")
    print(f"flaky's state at the end: {final_state}; SIGTERM to exit: {exit_s:.1f} s (drain timeout {DRAIN_S} s)")
    failed = [key for key in outcomes if key != "steady 200"]
    problems = (["steady requests failed: " + ", ".join(failed)] if failed else []) + \
        (["flaky stuck LOADING"] if final_state == "LOADING" else []) + \
        (["memory did not come back"] if end_usage[0] > start_usage[0] + 64 * mib else []) + \
        (["descriptors did not come back"] if end_usage[1] > start_usage[1] + 16 else []) + \
        ([f"SIGTERM took {exit_s:.1f} s"] if exit_s > DRAIN_S + 10 else [])
    print("OK" if not problems else "PROBLEMS: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
