"""jitserve's fronts against the floor of their own stack, and the serving core against a bare batcher.

In one run, alternating, round after round (this machine's speed drifts):

1. HTTP over loopback: ``wrk`` (a C client, one thread) sends the same request,
   one 16-float row, as JSON tensors and with the binary tensor extension, over
   1 and 64 keep-alive connections, to ``jitserve serve examples/mlp.py:serving``
   and to a bare uvicorn application (uvloop, httptools, as jitserve runs
   them) that answers every request with jitserve's own answer, precomputed:
   no decoding, batching, model or encoding. The ratio is what jitserve keeps
   of its stack (goal: >= 0.6 at 1 connection, >= 0.5 at 64);
2. gRPC over loopback: ``h2load`` (nghttp2's C HTTP/2 load generator, one
   thread; ghz is not packaged here) sends the same ``ModelInferRequest``
   (raw contents) on one connection with 1 and 64 concurrent streams, as a
   gRPC client multiplexes its calls, to jitserve's gRPC port and to a bare
   ``grpc.aio`` servicer on a thread of its own (as jitserve runs it)
   answering the precomputed response (goal: >= 0.8);
3. in process: 64 asyncio callers of ``js.batched_run_async`` with 1-row
   requests against ``bench/serving.py``'s bare Python batcher (a future per
   caller, one compiled call per batch on the event loop), on that script's
   MLP (256 -> 1024 -> 256), batch 64, 2 ms (goal: >= 0.8);
4. sockets left out: 64 asyncio callers on one uvloop loop send one-row
   requests (256 float32) to a served ``x * 2`` through the serving core
   alone, through ``HttpFront`` called as an ASGI application with the
   request and the response in memory (JSON, then binary tensors), and through
   the gRPC servicer (``GrpcFront.ModelInfer``, the request parsed from its
   bytes, the response serialized); the event loop's CPU per request, and
   what each front adds to the core's.

Every figure is printed, with the server's CPU per request (from /proc) for
the network runs; nothing is asserted but the answers: each server's answer
is checked before its load, wrk and h2load must see only 2xx responses, and
jitserve's statistics must count no failed request (gRPC's status travels in
trailers, which h2load does not read). ``--profile S`` adds a py-spy profile
(S seconds) of ``jitserve serve`` under 64 JSON connections: the functions
with the most samples while they hold the GIL, in themselves and in all.
``python3 dev.py bench front`` installs wrk and h2load (Debian's ``wrk`` and
``nghttp2-client``) when they are missing.

    python3 dev.py bench front [--seconds 5] [--rounds 3] [--parts http grpc in-process loop] [--profile 10]
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvloop

import jitserve as js
from jitserve.loadtest import closed_loop_async
from jitserve.protocol.grpc import MESSAGES, GrpcFront, parse
from jitserve.protocol.http import HttpFront
from jitserve.protocol.service import InferenceService

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
CALLERS, FEATURES = 64, 256
ROW = np.random.default_rng(0).normal(size=(1, FEATURES)).astype(np.float32)
EXPECTED = ROW * 2
EXPECTED_BYTES = EXPECTED.tobytes()
MLP_ROW = np.random.default_rng(1).normal(size=(1, 16)).astype(np.float32)  # one row of examples/mlp.py's input
CONNECTIONS = (1, 64)
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
# the headers of jitserve's answer the floor sends too (not the request id, nor urllib's "connection: close")
ANSWER_HEADERS = ("content-type", "content-length", "inference-header-content-length")
TOOLS = {"http": ("wrk", "wrk"), "grpc": ("h2load", "nghttp2-client")}  # part -> its load generator, its package
GOALS = {"HTTP JSON": {1: 0.6, 64: 0.5}, "HTTP binary": {1: 0.6, 64: 0.5}, "gRPC": {1: 0.8, 64: 0.8}}


# the requests and the bare servers ----------------------------------------------------------------------

def http_requests() -> dict[str, tuple[bytes, dict[str, str]]]:
    """The one request each HTTP protocol sends: its body and headers."""
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 16]}
    header = orjson.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": MLP_ROW.nbytes}}],
                           "outputs": [{"name": "output", "parameters": {"binary_data": True}}]})
    return {
        "HTTP JSON": (orjson.dumps({"inputs": [{**tensor, "data": MLP_ROW.reshape(-1).tolist()}]}),
                      {"Content-Type": "application/json"}),
        "HTTP binary": (header + MLP_ROW.tobytes(), {"Content-Type": "application/octet-stream",
                                                    "Inference-Header-Content-Length": str(len(header))}),
    }


def grpc_request() -> bytes:
    request = MESSAGES["ModelInferRequest"](model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(MLP_ROW.tobytes())
    return request.SerializeToString()


def mlp_reference() -> np.ndarray:
    """examples/mlp.py's answer to MLP_ROW, by numpy."""
    sys.path.insert(0, str(ROOT / "examples"))
    import mlp

    hidden = np.maximum(MLP_ROW @ mlp.W1, 0.0)
    logits = np.exp(hidden @ mlp.W2)
    return logits / logits.sum(axis=-1, keepdims=True)


def serve_bare(http_port: int, grpc_port: int, answers_path: str) -> None:
    """The floor: uvicorn (uvloop, httptools) with a bare ASGI callable, and ``grpc.aio`` on an event loop of
    its own thread, each answering every request with jitserve's answer to it, precomputed."""
    import uvicorn

    sys.path.insert(0, str(HERE.parent))
    from peers import grpc_floor

    answers = json.loads(Path(answers_path).read_text())
    http = {base64.b64decode(body): ([(name.encode(), value.encode()) for name, value in headers],
                                     base64.b64decode(answer)) for body, headers, answer in answers["http"]}
    grpc_answer = base64.b64decode(answers["grpc"])
    ready = ([(b"content-length", b"0")], b"")

    async def app(scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
                  ) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers, content = http[body] if scope["method"] == "POST" else ready
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    grpc_floor(grpc_port, lambda request: grpc_answer)
    uvicorn.run(app, host="127.0.0.1", port=http_port, loop="uvloop", http="httptools", lifespan="off",
                access_log=False, log_level="warning")


# processes, CPU and the load generators -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return {name.lower(): value for name, value in response.headers.items()}, response.read()


def wait_ready(port: int, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"no server was ready on port {port} within {seconds:g} s")


def start(argv: list[str], http_port: int) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_ready(http_port, process)
    except RuntimeError:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wrk_command(port: int, body_file: Path, headers: dict[str, str], connections: int, seconds: int) -> list[str]:
    """``wrk`` posting ``body_file`` with ``headers`` to the model's infer path (its script beside the body)."""
    script = body_file.with_suffix(".lua")
    script.write_text('wrk.method = "POST"\n'
                      + "".join(f'wrk.headers["{name}"] = "{value}"\n' for name, value in headers.items())
                      + f'local file = assert(io.open("{body_file}", "rb"))\nwrk.body = file:read("*a")\nfile:close()\n')
    return ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script),
            f"http://127.0.0.1:{port}/v2/models/mlp/infer"]


def run_wrk(port: int, body_file: Path, headers: dict[str, str], connections: int, seconds: int) -> float:
    """Requests/s of ``wrk`` with ``connections`` connections for ``seconds``; any non-2xx answer or socket
    error fails the run."""
    done = subprocess.run(wrk_command(port, body_file, headers, connections, seconds), capture_output=True, text=True,
                          check=True)
    if "Non-2xx" in done.stdout or "Socket errors" in done.stdout:
        raise RuntimeError(f"wrk saw failed requests on port {port}:\n{done.stdout}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", done.stdout).group(1))


def run_h2load(port: int, body_file: Path, streams: int, seconds: int) -> float:
    """Calls/s of ``h2load`` on one connection with ``streams`` concurrent streams for ``seconds``."""
    done = subprocess.run(["h2load", "-D", str(seconds), "--warm-up-time", "1", "-c", "1", "-m", str(streams),
                           "-d", str(body_file), "-H", "content-type: application/grpc", "-H", "te: trailers",
                           f"http://127.0.0.1:{port}{GRPC_PATH}"], capture_output=True, text=True, check=True)
    counts = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded", done.stdout)
    if counts is None or counts.group(2) != counts.group(3) or not re.search(r"status codes: \d+ 2xx, 0 3xx, 0 4xx, "
                                                                              r"0 5xx", done.stdout):
        raise RuntimeError(f"h2load saw failed calls on port {port}:\n{done.stdout}")
    return float(re.search(r"finished in [\d.]+s, ([\d.]+) req/s", done.stdout).group(1))


def failed_requests(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/mlp/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"][0]["inference_stats"]["fail"]["count"]


# 1 and 2: over the network -----------------------------------------------------------------------------

class Servers:
    """``jitserve serve examples/mlp.py:serving`` and the bare servers, their answers checked, for one run."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports = {"jitserve": (free_port(), free_port()), "bare": (free_port(), free_port())}
        http_port, grpc_port = self.ports["jitserve"]
        self.processes = {"jitserve": start([sys.executable, "-m", "jitserve", "serve",
                                             f"{ROOT / 'examples' / 'mlp.py'}:serving", "--port", str(http_port),
                                             "--grpc-port", str(grpc_port)], http_port)}
        self.http = http_requests()
        self.grpc = grpc_request()
        expected = mlp_reference().reshape(-1)
        answers: dict[str, Any] = {"http": []}
        for protocol, (body, headers) in self.http.items():
            (self.folder / f"{protocol}.body").write_bytes(body)
            got_headers, answer = http_post(http_port, "/v2/models/mlp/infer", body, headers)
            split = got_headers.get("inference-header-content-length")
            values = np.frombuffer(answer[int(split):], np.float32) if split else \
                np.asarray(orjson.loads(answer)["outputs"][0]["data"], np.float32)
            assert np.allclose(values, expected, rtol=1e-5, atol=1e-6), (protocol, values, expected)
            kept = [(name, value) for name, value in got_headers.items() if name in ANSWER_HEADERS]
            answers["http"].append((base64.b64encode(body).decode(), kept, base64.b64encode(answer).decode()))
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            answer = channel.unary_unary(GRPC_PATH)(self.grpc, timeout=30)
        values = np.frombuffer(MESSAGES["ModelInferResponse"].FromString(answer).raw_output_contents[0], np.float32)
        assert np.allclose(values, expected, rtol=1e-5, atol=1e-6), ("gRPC", values, expected)
        answers["grpc"] = base64.b64encode(answer).decode()
        (self.folder / "grpc.body").write_bytes(b"\0" + struct.pack(">I", len(self.grpc)) + self.grpc)
        (self.folder / "answers.json").write_text(json.dumps(answers))
        bare_http, bare_grpc = self.ports["bare"]
        self.processes["bare"] = start([sys.executable, "-P", str(HERE), "--serve-bare", str(bare_http),
                                        str(bare_grpc), str(self.folder / "answers.json")], bare_http)
        for body, headers in self.http.values():  # the floor answers the same bytes
            _, answer = http_post(bare_http, "/v2/models/mlp/infer", body, headers)
            assert answer == http_post(http_port, "/v2/models/mlp/infer", body, headers)[1]

    def close(self) -> None:
        for process in self.processes.values():
            stop(process)

    def measure(self, server: str, protocol: str, connections: int, seconds: int) -> dict[str, float]:
        """One load run: requests/s and the server's CPU per request (its whole process)."""
        http_port, grpc_port = self.ports[server]
        pid = self.processes[server].pid
        if protocol == "gRPC":
            body_file = self.folder / "grpc.body"
            run_h2load(grpc_port, body_file, connections, 1)  # warm-up: a connection, its first calls
            before, started = process_cpu(pid), time.perf_counter()
            rate = run_h2load(grpc_port, body_file, connections, seconds)
        else:
            body_file, headers = self.folder / f"{protocol}.body", self.http[protocol][1]
            run_wrk(http_port, body_file, headers, connections, 1)  # warm-up: the connections, their first requests
            before, started = process_cpu(pid), time.perf_counter()
            rate = run_wrk(http_port, body_file, headers, connections, seconds)
        cpu = process_cpu(pid) - before
        return {"requests_per_s": rate, "cpu_us": 1e6 * cpu / (rate * (time.perf_counter() - started))}


def network(args: argparse.Namespace) -> list[dict[str, Any]]:
    protocols = [p for p, part in (("HTTP JSON", "http"), ("HTTP binary", "http"), ("gRPC", "grpc"))
                 if part in args.parts]
    results = []
    with tempfile.TemporaryDirectory(prefix="jitserve-bench-front-") as folder:
        servers = Servers(Path(folder))
        try:
            for round_ in range(1, args.rounds + 1):
                for protocol in protocols:
                    for connections in CONNECTIONS:
                        order = ("bare", "jitserve") if round_ % 2 else ("jitserve", "bare")
                        cell = {server: servers.measure(server, protocol, connections, args.seconds)
                                for server in order}
                        result = {"round": round_, "protocol": protocol, "connections": connections, **{
                            f"{server}_{key}": value for server, figures in cell.items()
                            for key, value in figures.items()}}
                        result["ratio"] = result["jitserve_requests_per_s"] / result["bare_requests_per_s"]
                        results.append(result)
                        print(f"round {round_} {protocol:11} x{connections:<2}  bare {result['bare_requests_per_s']:8,.0f}"
                              f" req/s ({result['bare_cpu_us']:4.0f} us)  jitserve "
                              f"{result['jitserve_requests_per_s']:7,.0f} req/s ({result['jitserve_cpu_us']:4.0f} us)"
                              f"  ratio {result['ratio']:.2f}", flush=True)
            if args.profile:
                profile(servers, args.profile)
            failed = failed_requests(servers.ports["jitserve"][0])
            if failed:
                raise RuntimeError(f"jitserve counted {failed} failed requests during the load")
        finally:
            servers.close()
    return results


def profile(servers: Servers, seconds: float) -> None:
    """py-spy on jitserve serve (the samples of the thread holding the GIL) under 64 JSON connections."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed (pip install 'jitserve[bench]'): no profile")
        return
    http_port, _ = servers.ports["jitserve"]
    out = servers.folder / "profile.txt"
    body_file, headers = servers.folder / "HTTP JSON.body", servers.http["HTTP JSON"][1]
    load = subprocess.Popen(wrk_command(http_port, body_file, headers, 64, int(seconds) + 2),
                            stdout=subprocess.DEVNULL)
    time.sleep(1)
    subprocess.run([spy, "record", "--pid", str(servers.processes["jitserve"].pid), "--duration", str(int(seconds)),
                    "--rate", "250", "--gil", "--nonblocking", "--format", "raw", "--output", str(out)],
                   capture_output=True, check=True)
    load.wait()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r" \((?:.*/)?([^/:]+)(?::\d+)?\)$", r" (\1)", frame) for frame in stack.split(";")[1:]]
        total += int(count)
        own[frames[-1] if frames else "?"] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    print(f"\npy-spy, {seconds:g} s of jitserve serve under 64 JSON connections, {total} samples holding the GIL:")
    print("| function (its own samples) | share | function (with what it calls) | share |")
    print("|---|---|---|---|")
    skip = {"<module> (jitserve)", "main (cli.py)", "serve_command (cli.py)", "run (app.py)"}
    tops = [item for item in inclusive.most_common() if item[0] not in skip]
    for (name, count), (name_all, count_all) in zip(own.most_common(15), tops[:15]):
        print(f"| {name} | {100 * count / total:.1f}% | {name_all} | {100 * count_all / total:.1f}% |")


# 3: in process ---------------------------------------------------------------------------------------------

def in_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE.parent))
    import serving as serving_bench

    results = []
    for round_ in range(1, args.rounds + 1):
        ours = serving_bench.served(args.seconds, 0.002, lambda r: 1, f"mlp-async-{round_}", use_async=True)
        bare = serving_bench.bare_batcher(args.seconds, True)
        results.append({"round": round_, "jitserve": ours["rows_per_s"], "bare": bare,
                        "mean_batch": ours["mean_batch"], "ratio": ours["rows_per_s"] / bare})
        print(f"round {round_} in process, 64 x 1-row asyncio callers: bare batcher {bare:,.0f} rows/s, jitserve "
              f"{ours['rows_per_s']:,.0f} (mean batch {ours['mean_batch']:.1f}), ratio {results[-1]['ratio']:.2f}",
              flush=True)
    return results


# 4: sockets left out ---------------------------------------------------------------------------------------

def doubling() -> js.Serving:
    return js.Serving(lambda x: x * 2.0, batch_size=CALLERS, batch_timeout=0.002,
                      input_template=js.template((FEATURES,), "float32"))


def core_call(name: str) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        out = await js.batched_run_async(name, js.Batch.concatenate([ROW]))
        assert out.tobytes() == EXPECTED_BYTES
        return 1
    return call


def http_call(front: HttpFront, binary: bool) -> Callable[[], Awaitable[int]]:
    tensor: dict[str, Any] = {"name": "input", "datatype": "FP32", "shape": [1, FEATURES]}
    if binary:
        header = orjson.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": ROW.nbytes}}],
                               "outputs": [{"name": "output", "parameters": {"binary_data": True}}]})
        body = header + ROW.tobytes()
        headers = [(b"content-type", b"application/octet-stream"),
                   (b"inference-header-content-length", str(len(header)).encode())]
    else:
        body = orjson.dumps({"inputs": [{**tensor, "data": ROW.reshape(-1).tolist()}]})
        headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer",
             "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    checked: list[bytes] = []  # the first answer's body, once decoded and found right

    async def call() -> int:
        sent: list[dict[str, Any]] = []

        async def send(event: dict[str, Any]) -> None:
            sent.append(event)

        await front(scope, receive, send)
        start, answer = sent
        if checked:
            assert answer["body"] == checked[0]
            return 1
        assert start["status"] == 200, answer["body"]
        if binary:
            values = np.frombuffer(answer["body"][-ROW.nbytes:], np.float32)
        else:
            values = np.asarray(orjson.loads(answer["body"])["outputs"][0]["data"], np.float32)
        assert np.array_equal(values, EXPECTED.reshape(-1))
        checked.append(answer["body"])
        return 1
    return call


class _CallContext:
    """What ``ModelInfer`` asks of grpc's servicer context: metadata, and an abort that raises."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"the call was aborted: {code} {details}")


def grpc_call(front: GrpcFront) -> Callable[[], Awaitable[int]]:
    request = MESSAGES["ModelInferRequest"](model_name="m")
    request.inputs.add(name="input", datatype="FP32", shape=[1, FEATURES])
    request.raw_input_contents.append(ROW.tobytes())
    data = request.SerializeToString()
    context = _CallContext()
    checked: list[bytes] = []  # the first response, once decoded and found right

    async def call() -> int:
        response = (await front.ModelInfer(parse(MESSAGES["ModelInferRequest"], data), context)).SerializeToString()
        if checked:
            assert response == checked[0]
            return 1
        answer = MESSAGES["ModelInferResponse"].FromString(response)
        assert np.array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32), EXPECTED.reshape(-1))
        checked.append(response)
        return 1
    return call


def loop_cpu(call: Callable[[], Awaitable[int]], seconds: float) -> dict[str, float]:
    """64 callers for ``seconds`` after a warm-up second: requests/s and the loop's CPU per request."""
    closed_loop_async(lambda seed: call, CALLERS, 1.0, uvloop.new_event_loop)
    cpu = time.thread_time()
    load = closed_loop_async(lambda seed: call, CALLERS, seconds, uvloop.new_event_loop)
    return {"requests_per_s": load.rows_per_s, "cpu_us": 1e6 * (time.thread_time() - cpu) / load.calls}


def sockets_left_out(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with js.serve(doubling(), name="m") as server:
        service = InferenceService({"m": server})
        runs = {
            "serving core (js.batched_run_async)": core_call("m"),
            "HTTP front, JSON tensors": http_call(HttpFront(service), binary=False),
            "HTTP front, binary tensors": http_call(HttpFront(service), binary=True),
            "gRPC servicer (ModelInfer)": grpc_call(GrpcFront(service)),
        }
        for round_ in range(1, args.rounds + 1):
            for label, call in runs.items():
                results.append({"round": round_, "path": label, **loop_cpu(call, args.seconds)})
                print(f"round {round_} no sockets, {label}: {results[-1]['requests_per_s']:,.0f} req/s, "
                      f"{results[-1]['cpu_us']:.1f} us of the loop per request", flush=True)
    return results


# the report ------------------------------------------------------------------------------------------------

def spread(values: list[float], form: str) -> str:
    low, high = min(values), max(values)
    return format(low, form) if format(low, form) == format(high, form) else f"{low:{form}}-{high:{form}}"


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"\n{args.rounds} round(s) of {args.seconds} s per run, {os.cpu_count()} CPUs shared by servers and load "
          f"generators; ranges over the rounds")
    if results.get("network"):
        print("\nOver loopback, one 16-float row to examples/mlp.py (wrk for HTTP, h2load for gRPC), requests/s and "
              "the server's CPU per request:")
        print("| protocol | connections (streams) | bare stack | its CPU us | jitserve serve | its CPU us "
              "| jitserve / bare | goal |")
        print("|---|---|---|---|---|---|---|---|")
        for protocol in GOALS:
            for connections in CONNECTIONS:
                cell = [r for r in results["network"] if (r["protocol"], r["connections"]) == (protocol, connections)]
                if cell:
                    print(f"| {protocol} | {connections} | {spread([r['bare_requests_per_s'] for r in cell], ',.0f')} "
                          f"| {spread([r['bare_cpu_us'] for r in cell], '.0f')} "
                          f"| {spread([r['jitserve_requests_per_s'] for r in cell], ',.0f')} "
                          f"| {spread([r['jitserve_cpu_us'] for r in cell], '.0f')} "
                          f"| {spread([r['ratio'] for r in cell], '.2f')} | >= {GOALS[protocol][connections]} |")
    if results.get("in-process"):
        cell = results["in-process"]
        print("\nIn process, 64 asyncio callers of 1-row requests, bench/serving.py's MLP, batch 64 / 2 ms, rows/s:")
        print("| bare Python batcher | jitserve (js.batched_run_async) | mean batch | jitserve / bare | goal |")
        print("|---|---|---|---|---|")
        print(f"| {spread([r['bare'] for r in cell], ',.0f')} | {spread([r['jitserve'] for r in cell], ',.0f')} "
              f"| {spread([r['mean_batch'] for r in cell], '.1f')} | {spread([r['ratio'] for r in cell], '.2f')} "
              f"| >= 0.8 |")
    if results.get("loop"):
        print(f"\nSockets left out: {CALLERS} asyncio callers on one uvloop loop, 1-row requests of {FEATURES} "
              f"float32, x * 2 served with batch_size {CALLERS} / 2 ms:")
        print("| path | requests/s | event loop CPU per request | added to the core |")
        print("|---|---|---|---|")
        by_path: dict[str, list[dict[str, Any]]] = {}
        for r in results["loop"]:
            by_path.setdefault(r["path"], []).append(r)
        core = by_path.pop("serving core (js.batched_run_async)")
        print(f"| serving core (js.batched_run_async) | {spread([r['requests_per_s'] for r in core], ',.0f')} "
              f"| {spread([r['cpu_us'] for r in core], '.1f')} us | |")
        for label, cell in by_path.items():
            added = [r["cpu_us"] - c["cpu_us"] for r, c in zip(cell, core)]
            print(f"| {label} | {spread([r['requests_per_s'] for r in cell], ',.0f')} "
                  f"| {spread([r['cpu_us'] for r in cell], '.1f')} us | +{spread(added, '.1f')} us |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each measured run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every run, alternating the servers")
    parser.add_argument("--parts", nargs="+", default=["http", "grpc", "in-process", "loop"],
                        choices=["http", "grpc", "in-process", "loop"])
    parser.add_argument("--profile", type=float, default=0, help="seconds of py-spy on jitserve serve (0: none)")
    parser.add_argument("--serve-bare", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        http_port, grpc_port, answers = args.serve_bare
        serve_bare(int(http_port), int(grpc_port), answers)
        return
    for part, (tool, package) in TOOLS.items():
        if part in args.parts and shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed: python3 dev.py bench front installs it (apt-get install {package})")
    from jitserve.compilers.xla import run_cpu_computations_inline

    run_cpu_computations_inline()  # as jitserve serve runs XLA's CPU computations, and bench/serving.py
    results: dict[str, list[dict[str, Any]]] = {}
    if "http" in args.parts or "grpc" in args.parts:
        results["network"] = network(args)
    if "in-process" in args.parts:
        results["in-process"] = in_process(args)
    if "loop" in args.parts:
        results["loop"] = sockets_left_out(args)
    report(results, args)


if __name__ == "__main__":
    main()
