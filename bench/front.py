"""What the network fronts add to the serving core per request, sockets left out.

``bench/peers.py`` measures whole servers over loopback, where the HTTP and
gRPC stacks (uvicorn, ``grpc.aio``) and the load generator share the machine
with jitserve and move every figure by 10-30 %. This script isolates
jitserve's own code on the event loop: 64 asyncio callers on one uvloop loop
send one-row requests (256 float32) to a served ``x * 2`` (so that the model
costs next to nothing) through

1. the serving core alone: ``js.batched_run_async`` (what every front calls);
2. the HTTP front (``HttpFront``) as an ASGI application, with the request's
   scope, body and the response held in memory instead of a socket: JSON
   tensors, then the binary tensor extension;
3. the gRPC servicer (``GrpcFront.ModelInfer``): the request parsed from its
   bytes and the response serialized, with a stand-in for grpc's call context
   (it is only asked for metadata and to abort, which no request here does).

For each it prints requests/s and the event loop's CPU per request
(``time.thread_time``), and what the front adds to the core's CPU per
request. Every response is checked: the first by decoding it, the others
by comparing their bytes with it, so that checking costs the loop little.

    python3 dev.py bench front [--seconds 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import uvloop

import jitserve as js
from jitserve.loadtest import closed_loop_async
from jitserve.protocol.grpc import MESSAGES, GrpcFront, parse
from jitserve.protocol.http import HttpFront
from jitserve.protocol.service import InferenceService

CALLERS, FEATURES = 64, 256
ROW = np.random.default_rng(0).normal(size=(1, FEATURES)).astype(np.float32)
EXPECTED = ROW * 2
EXPECTED_BYTES = EXPECTED.tobytes()


def serving() -> js.Serving:
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


def measure(call: Callable[[], Awaitable[int]], seconds: float) -> dict[str, float]:
    """64 callers for ``seconds`` after a warm-up second: requests/s and the loop's CPU per request."""
    closed_loop_async(lambda seed: call, CALLERS, 1.0, uvloop.new_event_loop)
    cpu = time.thread_time()
    load = closed_loop_async(lambda seed: call, CALLERS, seconds, uvloop.new_event_loop)
    return {"requests_per_s": load.rows_per_s, "cpu_us": 1e6 * (time.thread_time() - cpu) / load.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each measured run")
    args = parser.parse_args()
    with js.serve(serving(), name="m") as server:
        service = InferenceService({"m": server})
        runs = {
            "serving core (js.batched_run_async)": core_call("m"),
            "HTTP front, JSON tensors": http_call(HttpFront(service), binary=False),
            "HTTP front, binary tensors": http_call(HttpFront(service), binary=True),
            "gRPC servicer (ModelInfer)": grpc_call(GrpcFront(service)),
        }
        results = {label: measure(call, args.seconds) for label, call in runs.items()}
    core = results["serving core (js.batched_run_async)"]["cpu_us"]
    print(f"{CALLERS} asyncio callers on one uvloop loop, 1-row requests of {FEATURES} float32, x * 2 served with "
          f"batch_size {CALLERS} / 2 ms; no sockets; {args.seconds:g} s per run")
    print("| path | requests/s | event loop CPU per request | added to the core |")
    print("|---|---|---|---|")
    for label, result in results.items():
        added = "" if result["cpu_us"] == core else f"{result['cpu_us'] - core:+.1f} us"
        print(f"| {label} | {result['requests_per_s']:,.0f} | {result['cpu_us']:.1f} us | {added} |")


if __name__ == "__main__":
    main()
