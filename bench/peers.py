"""jitserve against the serving peers, side by side over the network, with plots.

In one run, each server serves the same MLP (256 -> 1024 -> 256, float32,
``jax.jit``), batching at most 64 rows with a 2 ms window, on loopback:

- jitserve (``jitserve serve``): Open Inference Protocol over HTTP (JSON and
  binary tensors) and gRPC;
- Triton Inference Server through ``nvidia-pytriton`` (``@batch``, dynamic
  batching 64 / 2 ms): HTTP JSON, HTTP binary, gRPC. PyTriton needs numpy < 2,
  so this script builds it a virtual environment of its own
  (``.bench-venvs/pytriton``, with jax) on first use;
- MLServer (adaptive batching 64 / 2 ms, inference in the server process):
  HTTP JSON and gRPC (it has no binary tensor extension); its own virtual
  environment too (``.bench-venvs/mlserver``): it holds FastAPI below 0.116,
  which would downgrade what LitServe and Ray Serve run on here;
- LitServe (``max_batch_size`` 64, ``batch_timeout`` 2 ms) and Ray Serve
  (``@serve.batch``, 64 / 2 ms, HTTP proxy), each with its own JSON body
  (neither speaks the Open Inference Protocol), from the ``bench`` extra.

Beside them, not a peer, the floor of jitserve's own stack: uvicorn (uvloop,
httptools) with a bare ASGI callable and ``grpc.aio`` on a thread of its own,
as ``jitserve serve`` runs them, answering each request with its answer
precomputed (no decoding, batching, model or encoding). What it reaches is
the most any server on this stack can, here; the script prints it next to
twice the best peer (the goal) and jitserve.

Asked for only (``--peers ... jitserve-x2``), an experiment: two complete
jitserve processes sharing the HTTP port (``SO_REUSEPORT``), which bounds
what several front processes sharing one batching process could reach; the
script prints it over jitserve.

The peers batch up to 64 *requests* (LitServe, Ray Serve, MLServer) or 64
*rows* (Triton, jitserve); every peer pads the rows it runs to a power of two
and compiled those sizes before the run, as jitserve does, so nobody compiles
while measured.

The load comes from a separate process: one asyncio loop (uvloop) with one
keep-alive connection per caller, requests written from prepared bytes, so
that the client costs the machine little CPU (reported). Every answer is
checked against numpy's MLP. For 1, 8 and 64 closed-loop callers, with 1-row
requests and with 1..64-row requests (random, the same sequence for
everyone), it prints requests/s, rows/s, p50/p99 latency, the server's CPU
per request (its whole process tree, from /proc) and jitserve over the best
peer with the same protocol family; the plots go to ``bench/figures/`` (to
``.bench-venvs/figures/`` from a run of only some peers, callers or sizes).

    python3 dev.py bench peers [--seconds 4] [--callers 1 8 64] [--peers ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

FEATURES, HIDDEN, BATCH, TIMEOUT = 256, 1024, 64, 0.002
HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
VENVS = ROOT / ".bench-venvs"
FIGURES = HERE.parent / "figures"
PEER_VENVS = {  # peers whose pins clash with ours: their own environment, with jax
    "pytriton": ["nvidia-pytriton>=0.7,<0.8", "numpy<2", "jax[cpu]>=0.4.30"],
    "mlserver": ["mlserver>=1.7,<1.8", "jax[cpu]>=0.4.30"],
}
PADDED_SIZES = [1 << k for k in range(13)]  # what the peers pad a batch to: 1 .. 4,096 rows (64 requests x 64)


def weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(0, 0.05, (FEATURES, HIDDEN)).astype(np.float32),
            rng.normal(0, 0.05, (HIDDEN, FEATURES)).astype(np.float32))


def reference(x: np.ndarray) -> np.ndarray:
    w1, w2 = weights()
    return np.maximum(x @ w1, 0.0) @ w2


def jitted_mlp():
    """The MLP jitted, and a runner that pads the rows to a power of two (compiled at once for each)."""
    import jax
    import jax.numpy as jnp

    w1, w2 = weights()
    fn = jax.jit(lambda x: jnp.maximum(x @ w1, 0.0) @ w2)

    def run(x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        size = next(s for s in PADDED_SIZES if s >= rows)
        padded = x if size == rows else np.concatenate([x, np.zeros((size - rows, FEATURES), np.float32)])
        return np.asarray(fn(padded))[:rows]

    for size in PADDED_SIZES:
        run(np.zeros((size, FEATURES), np.float32))
    return run


def __getattr__(name: str):
    """``serving`` (and ``LitMLP``), built on first use, so that the peers' environments import this file
    without jitserve."""
    if name == "LitMLP":
        return lit_api_class()
    if name != "serving":
        raise AttributeError(name)
    return jitserve_serving()


def jitserve_serving():
    import jax.numpy as jnp

    import jitserve as js

    w1, w2 = weights()
    return js.Serving(lambda x: jnp.maximum(x @ w1, 0.0) @ w2, batch_size=BATCH, batch_timeout=TIMEOUT,
                      input_template=js.template((FEATURES,), "float32"))


# servers: each runs in the interpreter of its peer's environment ---------------------------------

def serve_pytriton(http_port: int, grpc_port: int) -> None:
    import sysconfig

    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    # Triton's Python stub links libpython by its soname; the first one found must be this interpreter's own,
    # whose standard library it loads (a system libpython of another patch release fails in multiprocessing)
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                                  os.environ.get("LD_LIBRARY_PATH")]))
    run = jitted_mlp()

    @batch
    def infer(input):  # the keyword is the tensor name PyTriton passes
        return {"output": run(input)}

    config = TritonConfig(http_address="127.0.0.1", http_port=http_port, grpc_address="127.0.0.1",
                          grpc_port=grpc_port, metrics_port=free_port(), log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(model_name="mlp", infer_func=infer,
                    inputs=[Tensor(name="input", dtype=np.float32, shape=(FEATURES,))],
                    outputs=[Tensor(name="output", dtype=np.float32, shape=(FEATURES,))],
                    config=ModelConfig(max_batch_size=BATCH,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=int(TIMEOUT * 1e6))))
        triton.serve()


MLSERVER_RUNTIME = '''
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceResponse
import peers


class MLP(MLModel):
    async def load(self) -> bool:
        self.run = peers.jitted_mlp()
        return True

    async def predict(self, payload):
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("output", self.run(x))])
'''


def serve_mlserver(http_port: int, grpc_port: int) -> None:
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="jitserve-bench-mlserver-"))
    (folder / "runtime.py").write_text(MLSERVER_RUNTIME)
    shutil.copy(HERE, folder / "peers.py")  # importable from the model folder, without the rest of bench/ beside it
    (folder / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port, "metrics_port": free_port(),
        "parallel_workers": 0, "debug": False}))
    (folder / "model-settings.json").write_text(json.dumps({
        "name": "mlp", "implementation": "runtime.MLP", "max_batch_size": BATCH, "max_batch_time": TIMEOUT}))
    os.execvp(str(Path(sys.executable).with_name("mlserver")), ["mlserver", "start", str(folder)])


def lit_api_class():
    """LitServe's API for the MLP. LitServe pickles it into its worker process, which finds it again as
    ``LitMLP`` of this module (the module ``__getattr__`` builds it there): litserve is imported only where
    it serves."""
    import litserve as ls

    class LitMLP(ls.LitAPI):
        def setup(self, device):
            self.run = jitted_mlp()

        def decode_request(self, request):
            return np.asarray(request["input"], np.float32)

        def batch(self, inputs):
            self.sizes = [len(x) for x in inputs]
            return np.concatenate(inputs)

        def predict(self, x):
            return self.run(x)

        def unbatch(self, output):
            return np.split(output, np.cumsum(self.sizes)[:-1])

        def encode_response(self, output):
            return {"output": output.tolist()}

    LitMLP.__qualname__ = "LitMLP"
    globals()["LitMLP"] = LitMLP
    return LitMLP


def serve_litserve(http_port: int, grpc_port: int) -> None:
    import litserve as ls

    server = ls.LitServer(lit_api_class()(max_batch_size=BATCH, batch_timeout=TIMEOUT), accelerator="cpu",
                          workers_per_device=1)
    server.run(host="127.0.0.1", port=http_port, log_level="warning", generate_client_file=False)


def serve_ray(http_port: int, grpc_port: int) -> None:
    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})

    @serve.deployment(max_ongoing_requests=4 * BATCH)
    class MLP:
        def __init__(self):
            self.run = jitted_mlp()

        @serve.batch(max_batch_size=BATCH, batch_wait_timeout_s=TIMEOUT)
        async def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
            output = self.run(np.concatenate(inputs))
            return np.split(output, np.cumsum([len(x) for x in inputs])[:-1])

        async def __call__(self, request: Request):
            x = np.asarray((await request.json())["input"], np.float32)
            return JSONResponse({"output": (await self.predict(x)).tolist()})

    serve.run(MLP.bind(), name="mlp", route_prefix="/predict")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    serve.shutdown()
    ray.shutdown()


def serve_jitserve(http_port: int, grpc_port: int) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "jitserve", "serve", f"{HERE}:serving", "--name", "mlp",
                              "--port", str(http_port), "--grpc-port", str(grpc_port)])


def floor_answers(port: int) -> tuple[dict[bytes, tuple[list, bytes]], dict[bytes, bytes]]:
    """Every request the load generator sends, and its answer ready to write, encoded by jitserve's own
    encoders (so the floor writes the same bytes jitserve does): HTTP (by body: response headers and body,
    JSON or binary tensors) and gRPC (by message: the serialized ModelInferResponse)."""
    from jitserve.protocol.grpc_request import infer_response
    from jitserve.protocol.http import _encode_response

    http: dict[bytes, tuple[list, bytes]] = {}
    grpc: dict[bytes, bytes] = {}
    for sizes in ("1-row", "mixed"):
        for protocol in ("http-json", "http-binary", "grpc"):
            for rows, request, expected in load_requests(sizes, protocol, "/v2/models/mlp/infer", port):
                outputs = [("output", expected.reshape(rows, FEATURES))]
                if protocol == "grpc":
                    grpc[request] = infer_response("mlp", "1", "", outputs, {}).SerializeToString()
                    continue
                binary = {"output": (True, None)} if protocol == "http-binary" else {}  # as the request asks
                _, headers, body = _encode_response("mlp", "1", None, outputs, binary, False)
                http[request.split(b"\r\n\r\n", 1)[1]] = ([*headers, (b"content-length", b"%d" % len(body))], body)
    return http, grpc


def serve_floor(http_port: int, grpc_port: int) -> None:
    """Not a peer: the least any server built on jitserve's stack does per request, measured the same way.
    uvicorn (uvloop, httptools) with a bare ASGI callable, and ``grpc.aio`` on an event loop of its own
    thread, as ``jitserve serve`` runs them, answering every request with its precomputed answer: no
    decoding, no batching, no model, no encoding."""
    import uvicorn

    http, answers = floor_answers(http_port)
    unknown = b"not one of the load generator's requests"
    ready, refused = ([(b"content-length", b"0")], b""), ([(b"content-length", b"%d" % len(unknown))], unknown)

    async def app(scope: dict, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, (headers, content) = (200, ready) if scope["method"] == "GET" else (
            (200, http[body]) if body in http else (400, refused))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    grpc_floor(grpc_port, answers.__getitem__)
    uvicorn.run(app, host="127.0.0.1", port=http_port, loop="uvloop", http="httptools", lifespan="off",
                access_log=False, log_level="warning")


def grpc_floor(port: int, answer: Callable[[bytes], bytes]) -> None:
    """A bare ``grpc.aio`` server on an event loop of a thread of its own, as ``jitserve serve`` runs gRPC,
    answering each ``ModelInfer`` request (its bytes) with ``answer(request)``, precomputed bytes."""
    import threading

    import grpc

    async def infer(request: bytes, context) -> bytes:
        return answer(request)

    async def serve_grpc() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    threading.Thread(target=asyncio.run, args=(serve_grpc(),), daemon=True).start()


def serve_jitserve_processes(http_port: int, grpc_port: int) -> None:
    """Not a peer: an experiment. Two complete ``jitserve serve`` processes (each its own HTTP front and
    batching, XLA's CPU computations inline as there) on one HTTP port (``SO_REUSEPORT``: the kernel gives each
    new connection to one of them). What it reaches bounds what several front processes sharing one batching
    process could: they would run the same fronts, and pass each request to the batching process and its answer
    back on top. Both have compiled before either listens. HTTP only: the load generator's gRPC channels share
    one connection (gRPC's global subchannel pool), which the kernel would give to one process."""
    children = [subprocess.Popen([sys.executable, "-P", str(HERE), "--serve", "jitserve-process", str(http_port),
                                  str(grpc_port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    for child in children:
        if child.stdout.readline() != "compiled\n":
            raise RuntimeError(f"a jitserve process exited with status {child.wait()} before it compiled")
    for child in children:
        child.stdin.write("listen\n")
        child.stdin.flush()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})  # stop() signals the whole group: the children too
    for child in children:
        child.wait()


def serve_jitserve_process(http_port: int, grpc_port: int) -> None:
    """One of :func:`serve_jitserve_processes`'s: says "compiled", waits for "listen", then serves HTTP on a
    port it shares; ends instead if its parent has gone."""
    import gc

    import uvicorn

    from jitserve.compilers.xla import run_cpu_computations_inline
    from jitserve.protocol.app import event_loop_factory, http_config
    from jitserve.protocol.service import InferenceService
    from jitserve.serving.registry import serve

    run_cpu_computations_inline()
    service = InferenceService({"mlp": serve(jitserve_serving(), name="mlp")})
    print("compiled", flush=True)
    if sys.stdin.readline() != "listen\n":  # the experiment's process has gone (its sibling failed): no orphan
        return
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", http_port))
    gc.collect()
    gc.freeze()  # as jitserve serve does
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(uvicorn.Server(http_config(service, "127.0.0.1", http_port)).serve(sockets=[listener]))


SERVERS = {"jitserve": serve_jitserve, "pytriton": serve_pytriton, "mlserver": serve_mlserver,
           "litserve": serve_litserve, "ray": serve_ray, "floor": serve_floor}
PROTOCOLS = {  # peer -> (protocol, the path it answers on) it is measured with
    "jitserve": [("http-json", "/v2/models/mlp/infer"), ("http-binary", "/v2/models/mlp/infer"), ("grpc", "")],
    "pytriton": [("http-json", "/v2/models/mlp/infer"), ("http-binary", "/v2/models/mlp/infer"), ("grpc", "")],
    "mlserver": [("http-json", "/v2/models/mlp/infer"), ("grpc", "")],
    "litserve": [("lit-json", "/predict")],
    "ray": [("lit-json", "/predict")],
    "floor": [("http-json", "/v2/models/mlp/infer"), ("http-binary", "/v2/models/mlp/infer"), ("grpc", "")],
    "jitserve-x2": [("http-json", "/v2/models/mlp/infer"), ("http-binary", "/v2/models/mlp/infer")],
}
EXPERIMENTS = {"jitserve-x2": serve_jitserve_processes}  # measured when asked for (--peers), never by default
HELPERS = {"jitserve-process": serve_jitserve_process}  # what an experiment starts
NOT_PEERS = {"jitserve", "floor", *EXPERIMENTS}  # what the peers are compared with, the floor of jitserve's own
#                                                  stack, and experiments with it
READY_PATHS = {"litserve": "/health", "ray": "/-/healthz"}
FAMILY = {"http-json": "HTTP JSON", "lit-json": "HTTP JSON", "http-binary": "HTTP binary", "grpc": "gRPC"}


# the load generator: a process of its own -----------------------------------------------------------

def request_bytes(protocol: str, path: str, port: int, x: np.ndarray) -> bytes:
    """One request, ready to write (HTTP), or the serialized ModelInferRequest (gRPC)."""
    rows = x.shape[0]
    if protocol == "grpc":
        from jitserve.protocol.grpc import MESSAGES

        request = MESSAGES["ModelInferRequest"](model_name="mlp")
        request.inputs.add(name="input", datatype="FP32", shape=[rows, FEATURES])
        request.raw_input_contents.append(x.tobytes())
        return request.SerializeToString()
    extra = b""
    if protocol == "http-json":
        body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, FEATURES],
                                       "data": x.ravel().tolist()}]}).encode()
    elif protocol == "lit-json":
        body = json.dumps({"input": x.tolist()}).encode()
    else:
        header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, FEATURES],
                                         "parameters": {"binary_data_size": x.nbytes}}],
                             "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
        body = header + x.tobytes()
        extra = b"Inference-Header-Content-Length: %d\r\n" % len(header)
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), port, extra, len(body))) + body


def load_requests(sizes: str, protocol: str, path: str, port: int) -> list[tuple[int, bytes, np.ndarray]]:
    """The 32 requests the callers draw from in turn, the same for every server: (rows, the request's bytes,
    the expected output rows)."""
    rng = np.random.default_rng(1)
    made = []
    for _ in range(32):
        rows = 1 if sizes == "1-row" else int(rng.integers(1, BATCH + 1))
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        made.append((rows, request_bytes(protocol, path, port, x), reference(x).ravel()))
    return made


def answer_of(protocol: str, headers: dict[bytes, bytes], body: bytes) -> np.ndarray:
    """The output rows in a response, whatever the protocol."""
    import orjson

    if protocol == "http-binary":
        split = int(headers[b"inference-header-content-length"])
        return np.frombuffer(body[split:], np.float32)
    if protocol == "lit-json":
        return np.asarray(orjson.loads(body)["output"], np.float32).ravel()
    if protocol == "grpc":
        from jitserve.protocol.grpc import MESSAGES

        response = MESSAGES["ModelInferResponse"].FromString(body)
        if response.raw_output_contents:
            return np.frombuffer(response.raw_output_contents[0], np.float32)
        return np.asarray(response.outputs[0].contents.fp32_contents, np.float32)
    return np.asarray(orjson.loads(body)["outputs"][0]["data"], np.float32)


async def http_call(reader, writer, request: bytes) -> tuple[dict[bytes, bytes], bytes]:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ", 2)[1]
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers[b"content-length"]))
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {body[:300]!r}")
    return headers, body


def load(spec: dict) -> dict:
    """Closed-loop callers against one server for ``spec['seconds']``; every answer checked."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    protocol, port, callers, seconds = spec["protocol"], spec["port"], spec["callers"], spec["seconds"]
    variants = load_requests(spec["sizes"], protocol, spec["path"], port)
    latencies: list[float] = []
    totals = {"requests": 0, "rows": 0}

    async def caller(index: int, stop_at: float) -> None:
        order = random.Random(index)
        if protocol == "grpc":
            import grpc

            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

            async def call(request: bytes) -> tuple[dict, bytes]:
                return {}, await infer(request, timeout=60)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)

            async def call(request: bytes) -> tuple[dict, bytes]:
                return await http_call(reader, writer, request)
        while time.perf_counter() < stop_at:
            rows, request, expected = variants[order.randrange(len(variants))]
            started = time.perf_counter()
            headers, body = await call(request)
            latencies.append(time.perf_counter() - started)
            got = answer_of(protocol, headers, body)
            if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-3, atol=1e-4):
                raise AssertionError(f"wrong answer from port {port} ({protocol}): {got[:4]} vs {expected[:4]}")
            totals["requests"] += 1
            totals["rows"] += rows
        if protocol == "grpc":
            await channel.close()
        else:
            writer.close()

    async def main() -> float:
        await asyncio.gather(*(caller(i, time.perf_counter() + 0.5) for i in range(callers)))  # warm-up
        latencies.clear()
        totals.update(requests=0, rows=0, warm_up=totals["requests"])
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(caller(i, start + seconds) for i in range(callers)))
        totals["client_cpu_s"] = time.process_time() - cpu
        return time.perf_counter() - start

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        elapsed = runner.run(main())
    latencies.sort()
    return {"requests_per_s": totals["requests"] / elapsed, "rows_per_s": totals["rows"] / elapsed,
            "p50": latencies[len(latencies) // 2], "p99": latencies[int(len(latencies) * 0.99)],
            "requests": totals["requests"], "all_requests": totals["requests"] + totals["warm_up"],
            "client_cpu_us": 1e6 * totals["client_cpu_s"] / totals["requests"]}


# the driver -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_for(peer: str) -> Path | None:
    """The interpreter a peer runs in: its own environment (built on first use), else this one."""
    if peer not in PEER_VENVS:
        return Path(sys.executable)
    venv = VENVS / peer
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"building {venv} for {peer} (once; {', '.join(PEER_VENVS[peer])})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_VENVS[peer]])
        if done.returncode != 0:
            print(f"{peer}: could not install {PEER_VENVS[peer]}; skipped", flush=True)
            return None
    return python


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent and child not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(p, 0.0) for p in tree)


def wait_ready(peer: str, port: int, process: subprocess.Popen, seconds: float = 300) -> None:
    path = READY_PATHS.get(peer, "/v2/models/mlp/ready")
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{peer} exited with status {process.returncode} before it was ready")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
                connection.sendall(request)
                if connection.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{peer} was not ready on port {port} within {seconds:g} s")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (a peer's helper processes too), SIGKILL after 60 s."""
    for sent, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        if server.poll() is not None:
            return
        os.killpg(server.pid, sent)
        try:
            server.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def measure_peer(peer: str, args: argparse.Namespace) -> list[dict]:
    python = python_for(peer)
    if python is None:
        return []
    http_port, grpc_port = free_port(), free_port()
    log = open(VENVS / f"{peer}.log", "w")  # noqa: SIM115 - the server writes to it while it runs
    server = subprocess.Popen([str(python), "-P", str(HERE), "--serve", peer, str(http_port), str(grpc_port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results = []
    try:
        wait_ready(peer, http_port, server)
        for protocol, path in PROTOCOLS[peer]:
            for sizes in args.sizes:
                for callers in args.callers:
                    spec = {"protocol": protocol, "path": path, "callers": callers, "seconds": args.seconds,
                            "sizes": sizes, "port": grpc_port if protocol == "grpc" else http_port}
                    before = process_tree_cpu(server.pid)
                    done = subprocess.run([sys.executable, "-P", str(HERE), "--load", json.dumps(spec)],
                                          capture_output=True, text=True)
                    server_cpu = process_tree_cpu(server.pid) - before
                    if done.returncode != 0:
                        print(f"{peer} {protocol} {sizes} x{callers}: FAILED: {done.stderr.strip().splitlines()[-1][:500]}", flush=True)
                        continue
                    result = {**spec, **json.loads(done.stdout.splitlines()[-1]), "peer": peer}
                    result["server_cpu_us"] = 1e6 * server_cpu / result["all_requests"]  # the warm-up's too
                    results.append(result)
                    print(f"{peer:9} {protocol:11} {sizes:6} x{callers:<3} {result['requests_per_s']:9,.0f} req/s "
                          f"{result['rows_per_s']:10,.0f} rows/s  p50 {result['p50'] * 1e3:7.2f} ms  "
                          f"p99 {result['p99'] * 1e3:7.2f} ms  server {result['server_cpu_us']:6.0f} us/req  "
                          f"client {result['client_cpu_us']:4.0f} us/req", flush=True)
    except RuntimeError as error:
        print(f"{peer}: {error} (its log: {log.name})", flush=True)
    finally:
        stop(server)
        log.close()
    return results


def jitserve_and_best_peer(results: list[dict], sizes: str, callers: int, family: str
                           ) -> tuple[dict | None, dict | None]:
    """jitserve's result and the best peer's (most rows/s) for one cell of sizes, callers and protocol family."""
    cell = [r for r in results if (r["sizes"], r["callers"], FAMILY[r["protocol"]]) == (sizes, callers, family)]
    ours = next((r for r in cell if r["peer"] == "jitserve"), None)
    return ours, max((r for r in cell if r["peer"] not in NOT_PEERS), key=lambda r: r["rows_per_s"], default=None)


def report(results: list[dict], args: argparse.Namespace) -> None:
    print()
    print(f"MLP {FEATURES}->{HIDDEN}->{FEATURES} float32 (jax.jit, CPU), batch 64 / 2 ms for every server, "
          f"{args.seconds:g} s per run, loopback, {os.cpu_count()} CPUs shared by server and load generator")
    print("| sizes | callers | server | protocol | requests/s | rows/s | p50 ms | p99 ms | server CPU us/request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["sizes"], r["callers"], FAMILY[r["protocol"]], -r["rows_per_s"])):
        print(f"| {r['sizes']} | {r['callers']} | {r['peer']} | {r['protocol']} | {r['requests_per_s']:,.0f} "
              f"| {r['rows_per_s']:,.0f} | {r['p50'] * 1e3:.2f} | {r['p99'] * 1e3:.2f} | {r['server_cpu_us']:,.0f} |")
    print()
    print("jitserve over the best peer with the same protocol family (goal >= 2x at an equal or better p99):")
    print("| sizes | callers | protocol | jitserve rows/s | best peer | its rows/s | ratio | p99 jitserve / peer ms |")
    print("|---|---|---|---|---|---|---|---|")
    for sizes in args.sizes:
        for callers in args.callers:
            for family in ("HTTP JSON", "HTTP binary", "gRPC"):
                ours, best = jitserve_and_best_peer(results, sizes, callers, family)
                if ours is None or best is None:
                    continue
                print(f"| {sizes} | {callers} | {family} | {ours['rows_per_s']:,.0f} | {best['peer']} "
                      f"| {best['rows_per_s']:,.0f} | {ours['rows_per_s'] / best['rows_per_s']:.2f}x "
                      f"| {ours['p99'] * 1e3:.1f} / {best['p99'] * 1e3:.1f} |")
    experiments = [r for r in results if r["peer"] in EXPERIMENTS]
    if experiments:
        print()
        print("experiments on jitserve's stack, against jitserve as it serves (jitserve-x2: two processes on one port):")
        print("| experiment | sizes | callers | protocol | its rows/s | jitserve rows/s | ratio | p99 ms, it / jitserve "
              "| server CPU us/request, it / jitserve |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(experiments, key=lambda r: (r["peer"], r["sizes"], r["callers"], r["protocol"])):
            ours = next((o for o in results if o["peer"] == "jitserve" and all(
                o[key] == r[key] for key in ("sizes", "callers", "protocol"))), None)
            if ours is not None:
                print(f"| {r['peer']} | {r['sizes']} | {r['callers']} | {r['protocol']} | {r['rows_per_s']:,.0f} "
                      f"| {ours['rows_per_s']:,.0f} | {r['rows_per_s'] / ours['rows_per_s']:.2f}x "
                      f"| {r['p99'] * 1e3:.1f} / {ours['p99'] * 1e3:.1f} "
                      f"| {r['server_cpu_us']:,.0f} / {ours['server_cpu_us']:,.0f} |")
    floors = [r for r in results if r["peer"] == "floor"]
    if not floors:
        return
    print()
    print("the floor: jitserve's stack answering precomputed bytes, no work (what any server on it can reach):")
    print("| sizes | callers | protocol | floor rows/s | floor server CPU us/request | 2x the best peer | jitserve rows/s "
          "| jitserve / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for floor in sorted(floors, key=lambda r: (r["sizes"], r["callers"], r["protocol"])):
        ours, best = jitserve_and_best_peer(results, floor["sizes"], floor["callers"], FAMILY[floor["protocol"]])
        goal = f"{2 * best['rows_per_s']:,.0f}" if best else ""
        mine = f"{ours['rows_per_s']:,.0f} | {ours['rows_per_s'] / floor['rows_per_s']:.2f}" if ours else " | "
        print(f"| {floor['sizes']} | {floor['callers']} | {floor['protocol']} | {floor['rows_per_s']:,.0f} "
              f"| {floor['server_cpu_us']:,.0f} | {goal} | {mine} |")


def plot(results: list[dict], args: argparse.Namespace) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install 'jitserve[bench]'): no plots")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = (sorted(args.peers), args.callers, sorted(args.sizes)) == (sorted(SERVERS), [1, 8, 64], ["1-row", "mixed"])
    folder = FIGURES if full else VENVS / "figures"  # a partial run leaves the committed figures alone
    folder.mkdir(exist_ok=True)
    families = ["HTTP JSON", "HTTP binary", "gRPC"]
    for sizes in args.sizes:
        figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
        for column, family in enumerate(families):
            group = [r for r in results if r["sizes"] == sizes and FAMILY[r["protocol"]] == family]
            for peer in SERVERS:
                mine = sorted((r for r in group if r["peer"] == peer), key=lambda r: r["callers"])
                if not mine:
                    continue
                callers = [r["callers"] for r in mine]
                style = {"color": "gray", "linestyle": "--"} if peer == "floor" else {}  # not a peer
                label = "floor (the stack alone)" if peer == "floor" else peer
                axes[0][column].plot(callers, [r["rows_per_s"] for r in mine], marker="o", label=label, **style)
                axes[1][column].plot(callers, [r["p99"] * 1e3 for r in mine], marker="o", label=f"{label} p99",
                                     **style)
                axes[1][column].plot(callers, [r["p50"] * 1e3 for r in mine], marker=".", linestyle=":",
                                     color=axes[1][column].lines[-1].get_color(), label=f"{label} p50")
            axes[0][column].set_title(f"{family}: throughput")
            axes[1][column].set_title(f"{family}: latency")
            axes[0][column].set_ylabel("rows/s")
            axes[1][column].set_ylabel("ms")
            for row in (0, 1):
                axes[row][column].set_xscale("log", base=2)
                axes[row][column].set_xticks(args.callers, [str(c) for c in args.callers])
                axes[row][column].set_xlabel("closed-loop callers")
                axes[row][column].grid(alpha=0.3)
            axes[1][column].set_yscale("log")
            axes[0][column].legend(fontsize=8)
            axes[1][column].legend(fontsize=7, ncol=2)
        figure.suptitle(f"MLP 256-1024-256 on {os.cpu_count()} CPUs, batch 64 / 2 ms, {sizes} requests")
        figure.tight_layout()
        path = folder / f"peers-{sizes}.png"
        figure.savefig(path, dpi=80)
        print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each measured run")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sizes", nargs="+", default=["1-row", "mixed"], choices=["1-row", "mixed"])
    parser.add_argument("--peers", nargs="+", default=list(SERVERS),
                        choices=[*SERVERS, *EXPERIMENTS])
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        peer, http_port, grpc_port = args.serve
        {**SERVERS, **EXPERIMENTS, **HELPERS}[peer](int(http_port), int(grpc_port))
        return
    if args.load:
        print(json.dumps(load(json.loads(args.load))))
        return
    VENVS.mkdir(exist_ok=True)
    results = [result for peer in args.peers for result in measure_peer(peer, args)]
    (VENVS / "peers.json").write_text(json.dumps(results, indent=1))
    report(results, args)
    plot(results, args)


if __name__ == "__main__":
    main()
