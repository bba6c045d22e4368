"""A short soak of ``jitserve serve`` at 1,024 open files: legitimate HTTP, gRPC and gRPC-stream callers under
a flood of idle and stalled connections.

The server (``examples/mlp.py``, soft and hard limit of 1,024 descriptors, ``--read-timeout 2``) starts;
legitimate callers open their connections, then for ``--seconds`` (30) seconds:

- 4 HTTP callers send JSON inferences, each on a new connection (a client that does not keep them alive);
- 2 gRPC callers send ``ModelInfer`` on their channel, opened before the flood;
- 1 gRPC stream caller sends 20 requests at a time on one ``ModelStreamInfer`` stream and reads the replies;
- the flood holds 1,200 idle TCP connections to the gRPC port and 900 to the HTTP port, half of those
  sending the start of a request line and stopping (slowloris), reopening each as the server closes it.

Every legitimate answer is checked (the MLP's outputs are probabilities: each row sums to 1). It prints the
answers by kind (HTTP 200, HTTP 503 with ``Retry-After``, gRPC OK, anything else), the server's resident memory
and open descriptors before, at their peak and 5 s after the flood, and exits 1 if any legitimate request got
anything but a 200, a 503 with ``Retry-After`` or a gRPC OK, or if memory or descriptors did not come back
(within 64 MiB and 8 descriptors of the baseline). Loopback only; bounded in count and time.

    python3 dev.py bench soak [--seconds 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from jitserve.protocol.grpc import MESSAGES

ROOT = Path(__file__).resolve().parents[1]
OPEN_FILES = 1024
FLOOD = {"grpc": 1200, "http": 900}
ROW = np.linspace(-1, 1, 16, dtype=np.float32)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(port: int, grpc_port: int) -> subprocess.Popen:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))

    process = subprocess.Popen([sys.executable, "-m", "jitserve", "serve", "examples/mlp.py:serving", "--name", "mlp",
                                "--port", str(port), "--grpc-port", str(grpc_port), "--read-timeout", "2"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("jitserve serve did not become ready in 120 s")


def usage(pid: int) -> tuple[int, int]:
    """The server's resident memory (bytes) and open descriptors."""
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def checked(rows: np.ndarray) -> bool:
    return rows.shape == (1, 4) and bool(np.allclose(rows.sum(axis=1), 1.0, atol=1e-5))


def http_caller(port: int, stop: threading.Event, outcomes: collections.Counter) -> None:
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                   "data": ROW.tolist()}]}).encode()
    while not stop.is_set():
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/mlp/infer", body,
                                         {"Connection": "close"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                output = json.loads(response.read())["outputs"][0]
                good = checked(np.asarray(output["data"], np.float32).reshape(output["shape"]))
                outcomes["HTTP 200" if good else "HTTP 200, wrong outputs"] += 1
        except urllib.error.HTTPError as error:
            clean = error.code == 503 and error.headers.get("retry-after") is not None
            outcomes["HTTP 503 with Retry-After" if clean else f"HTTP {error.code}"] += 1
            time.sleep(0.05)
        except OSError as error:
            reason = getattr(error, "reason", error)
            outcomes[f"HTTP {type(reason).__name__}"] += 1


def infer_request(request_id: str = "") -> object:
    request = MESSAGES["ModelInferRequest"](model_name="mlp", id=request_id)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(ROW[None].tobytes())
    return request


def answer_rows(response: object) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(1, 4)


def grpc_caller(channel: grpc.Channel, stop: threading.Event, outcomes: collections.Counter) -> None:
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                response_deserializer=MESSAGES["ModelInferResponse"].FromString)
    while not stop.is_set():
        try:
            outcomes["gRPC OK" if checked(answer_rows(infer(infer_request(), timeout=30))) else "gRPC wrong"] += 1
        except grpc.RpcError as error:
            outcomes[f"gRPC {error.code().name}"] += 1


def stream_caller(channel: grpc.Channel, stop: threading.Event, outcomes: collections.Counter) -> None:
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   request_serializer=MESSAGES["ModelInferRequest"].SerializeToString,
                                   response_deserializer=MESSAGES["ModelStreamInferResponse"].FromString)
    while not stop.is_set():
        try:
            for reply in stream(iter([infer_request(f"r{index}") for index in range(20)]), timeout=60):
                good = not reply.error_message and checked(answer_rows(reply.infer_response))
                outcomes["gRPC stream OK" if good else f"gRPC stream error: {reply.error_message}"] += 1
        except grpc.RpcError as error:
            outcomes[f"gRPC stream {error.code().name}"] += 1


def flood(ports: dict[str, int], stop: threading.Event, opened: collections.Counter) -> None:
    """Hold ``FLOOD`` idle connections per port (half of the HTTP ones stalled inside a request line),
    reopening those the server closed, until ``stop``."""
    held: dict[str, list[socket.socket]] = {kind: [] for kind in ports}
    while not stop.is_set():
        for kind, port in ports.items():
            alive = []
            for connection in held[kind]:
                try:
                    if connection.recv(65536, socket.MSG_DONTWAIT) == b"":
                        connection.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    connection.close()
                    continue
                alive.append(connection)
            while len(alive) < FLOOD[kind] and not stop.is_set():
                try:
                    connection = socket.create_connection(("127.0.0.1", port), timeout=2)
                    if kind == "http" and len(alive) % 2:
                        connection.sendall(b"POST /v2/models/mlp/in")
                except OSError:
                    break
                alive.append(connection)
                opened[kind] += 1
            held[kind] = alive
        stop.wait(0.5)
    for connections in held.values():
        for connection in connections:
            connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the flood itself holds over 2,000 sockets
    port, grpc_port = free_port(), free_port()
    server = start(port, grpc_port)
    try:
        time.sleep(1)
        baseline = usage(server.pid)
        outcomes: collections.Counter = collections.Counter()
        opened: collections.Counter = collections.Counter()
        stop, flood_stop = threading.Event(), threading.Event()
        channels = [grpc.insecure_channel(f"127.0.0.1:{grpc_port}") for _ in range(3)]
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=30)
        callers = [threading.Thread(target=http_caller, args=(port, stop, outcomes)) for _ in range(4)]
        callers += [threading.Thread(target=grpc_caller, args=(channel, stop, outcomes)) for channel in channels[:2]]
        callers.append(threading.Thread(target=stream_caller, args=(channels[2], stop, outcomes)))
        flooder = threading.Thread(target=flood, args=({"grpc": grpc_port, "http": port}, flood_stop, opened))
        for thread in [*callers, flooder]:
            thread.start()
        peak = baseline
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            time.sleep(0.5)
            peak = tuple(max(a, b) for a, b in zip(peak, usage(server.pid), strict=True))
        flood_stop.set()
        flooder.join()
        stop.set()
        for thread in callers:
            thread.join(60)
        for channel in channels:
            channel.close()
        time.sleep(5)
        after = usage(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    mib = 2**20
    print(f"jitserve serve examples/mlp.py at {OPEN_FILES} open files, --read-timeout 2, {args.seconds:g} s; "
          f"flood connections opened: {opened['grpc']:,} to gRPC, {opened['http']:,} to HTTP")
    print("| legitimate answers | count |\n|---|---|")
    for kind, count in sorted(outcomes.items()):
        print(f"| {kind} | {count:,} |")
    print("| server | baseline | peak | 5 s after |\n|---|---|---|---|")
    print(f"| resident memory | {baseline[0] / mib:.0f} MiB | {peak[0] / mib:.0f} MiB | {after[0] / mib:.0f} MiB |")
    print(f"| open descriptors | {baseline[1]} | {peak[1]} | {after[1]} |")
    clean = {"HTTP 200", "HTTP 503 with Retry-After", "gRPC OK", "gRPC stream OK"}
    bad = {kind: count for kind, count in outcomes.items() if kind not in clean}
    recovered = after[0] - baseline[0] < 64 * mib and after[1] - baseline[1] <= 8
    print(f"unclean answers: {bad or 'none'}; memory and descriptors back to baseline: {recovered}")
    if bad or not recovered or not outcomes["HTTP 200"] or not outcomes["gRPC OK"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
