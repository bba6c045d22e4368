"""OpenTelemetry traces: spans of requests and batches checked with the SDK's in-memory exporter behind real HTTP
and gRPC fronts on loopback, and `jitserve serve --trace-endpoint` exporting OTLP/HTTP to a collector stub."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import jitserve as js

pytest.importorskip("opentelemetry.sdk")
grpcclient = pytest.importorskip("tritonclient.grpc")
import generation_models  # noqa: E402
import uvicorn  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from jitserve.protocol import app  # noqa: E402
from jitserve.protocol.grpc import GrpcServer  # noqa: E402
from jitserve.protocol.limits import Limits  # noqa: E402
from jitserve.protocol.service import InferenceService  # noqa: E402
from jitserve.protocol.tracing import Tracing  # noqa: E402
from netutil import ROOT, free_port, start_server, stop  # noqa: E402
from waiting import HANG_S, until  # noqa: E402

TRACE_IDS = ("0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737")
PARENT = "b7ad6b7169203331"


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{PARENT}-01"


def body(value: float) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]}).encode()


def post(port: int, payload: bytes, headers: dict) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v2/models/traced/infer", payload, headers)
        return connection.getresponse().status
    finally:
        connection.close()


@contextlib.contextmanager
def traced_fronts(name: str, served) -> Iterator[tuple[int, int, InMemorySpanExporter]]:
    """``served`` (a Serving or a Generation) as model ``name`` behind real HTTP and gRPC fronts on loopback,
    its spans kept in memory: (HTTP port, gRPC port, exporter)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port, grpc_port = free_port(), free_port()
    with js.serve(served, name=name) as server:
        service = InferenceService({name: server}, tracing=Tracing(provider))
        http_server = uvicorn.Server(app.http_config(service, "127.0.0.1", port))
        http_thread = threading.Thread(target=http_server.run, daemon=True)
        http_thread.start()
        grpc_server = GrpcServer(service, "127.0.0.1", grpc_port, Limits())
        grpc_server.start()
        try:
            while not http_server.started:
                time.sleep(0.05)
            yield port, grpc_port, exporter
        finally:
            grpc_server.stop(1)
            http_server.should_exit = True
            http_thread.join(10)


def children_of(spans, parent) -> list[str]:
    return sorted(span.name for span in spans if span.parent is not None and span.parent.span_id == parent.context.span_id)


def test_spans_of_requests_and_their_batch_with_w3c_parents():
    # a batch goes when its 2 rows are in, not at a deadline that a busy machine might reach between two callers
    serving = js.Serving(lambda x: x * 2, batch_size=2, batch_sizes=[2], batch_timeout=HANG_S, adaptive=False,
                         input_template=js.template((4,), "float32"))

    def grpc_call() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        tensor = grpcclient.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        client.infer("traced", [tensor], headers={"traceparent": traceparent(TRACE_IDS[2])})
        statuses.append(200)

    with traced_fronts("traced", serving) as (port, grpc_port, exporter):
        statuses: list[int] = []
        pairs = [[lambda i=i: statuses.append(post(port, body(i), {"traceparent": traceparent(TRACE_IDS[i])}))
                  for i in range(2)],  # the two traced HTTP requests: one batch runs them
                 [grpc_call, lambda: statuses.append(post(port, body(1), {}))]]  # no traceparent: a trace of its own
        for pair in pairs:
            callers = [threading.Thread(target=call) for call in pair]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(HANG_S)
        assert statuses == [200] * 4
        until(lambda: sum(span.name == "batch" for span in exporter.get_finished_spans()) >= 2, "2 batch spans")
    spans = exporter.get_finished_spans()
    requests = [span for span in spans if span.name in ("http infer", "grpc infer")]
    assert sorted(span.name for span in requests) == ["grpc infer", "http infer", "http infer", "http infer"]
    by_trace = {f"{span.context.trace_id:032x}": span for span in requests}
    for trace_id, protocol in zip(TRACE_IDS, ("http", "http", "grpc")):
        request = by_trace[trace_id]
        assert request.name == f"{protocol} infer" and f"{request.parent.span_id:016x}" == PARENT, \
            "the request's span is the child of its traceparent"
        assert children_of(spans, request) == ["queue", "receive", "send"]
        assert request.attributes["jitserve.model"] == "traced" and request.attributes["jitserve.status"] in ("200", "OK")
    untraced = [span for trace_id, span in by_trace.items() if trace_id not in TRACE_IDS]
    assert len(untraced) == 1 and untraced[0].parent is None
    batches = [span for span in spans if span.name == "batch"]
    shared = [batch for batch in batches if {f"{link.context.trace_id:032x}" for link in batch.links} == set(TRACE_IDS[:2])]
    assert len(shared) == 1, "the two concurrent HTTP requests ran in one batch, linked to both"
    assert shared[0].attributes["jitserve.batch.rows"] == 2 and shared[0].parent is None
    executes = [span for span in spans if span.name == "execute" and span.parent.span_id == shared[0].context.span_id]
    assert len(executes) == 1 and executes[0].end_time <= shared[0].end_time
    queue = next(span for span in spans if span.name == "queue"
                 and span.parent.span_id == by_trace[TRACE_IDS[0]].context.span_id)
    assert queue.end_time == shared[0].start_time, "a request's queue span ends as its batch forms"


def test_spans_of_streamed_generation_requests_over_sse_and_grpc_streams():
    generation = js.Generation(generation_models.prefill, generation_models.decode, params={}, slots=2,
                               max_length=64, prefill_lengths=[8], logits=True)
    prompt = np.array([5, 6, 7], np.int32)
    with traced_fronts("gen", generation) as (port, grpc_port, exporter):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        payload = json.dumps({"inputs": [{"name": "prompt", "datatype": "INT32", "shape": [3], "data": prompt.tolist()}],
                              "parameters": {"max_steps": 5}}).encode()
        connection.request("POST", "/v2/models/gen/infer_stream", payload, {"traceparent": traceparent(TRACE_IDS[0])})
        answer = connection.getresponse()
        assert answer.status == 200 and answer.read().count(b"data: ") == 5
        connection.close()
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        client.start_stream(callback=lambda result, error: results.put(error), headers={
            "traceparent": traceparent(TRACE_IDS[1])})
        tensor = grpcclient.InferInput("prompt", [3], "INT32")
        tensor.set_data_from_numpy(prompt)
        client.async_stream_infer("gen", [tensor], parameters={"max_steps": 4})
        assert [results.get(timeout=30) for _ in range(4)] == [None] * 4
        client.stop_stream()
        until(lambda: any(span.name.endswith("stream infer") for span in exporter.get_finished_spans()),
              "the stream's span")
    spans = exporter.get_finished_spans()
    for name, trace_id, outputs, status in (("http infer_stream", TRACE_IDS[0], 5, "200"),
                                            ("grpc stream infer", TRACE_IDS[1], 4, "OK")):
        request = next(span for span in spans if span.name == name)
        assert f"{request.context.trace_id:032x}" == trace_id and f"{request.parent.span_id:016x}" == PARENT
        assert children_of(spans, request) == ["receive", "stream"]
        assert [event.name for event in request.events] == ["first output"]
        assert request.attributes["jitserve.outputs"] == outputs and request.attributes["jitserve.status"] == status
        stream = next(span for span in spans if span.name == "stream" and span.parent.span_id == request.context.span_id)
        assert stream.start_time <= request.events[0].timestamp <= stream.end_time, "the first output is in its stream"


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector stub: keeps the bodies posted to /v1/traces."""

    received: list[bytes] = []

    def do_POST(self):
        self.received.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_serve_exports_spans_over_otlp_when_asked():
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--trace-endpoint", endpoint, "--no-grpc")
    try:
        payload = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                          "data": [0.5] * 16}]}).encode()
        status, _, _ = running.request("POST", "/v2/models/mlp/infer", payload,
                                       {"traceparent": traceparent(TRACE_IDS[0])})
        assert status == 200
    finally:
        stop(running)  # the exit flushes the spans
        collector.shutdown()
    names, trace_ids, services = [], set(), set()
    for data in Collector.received:
        for resource_spans in ExportTraceServiceRequest.FromString(data).resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            for scope in resource_spans.scope_spans:
                names += [span.name for span in scope.spans]
                trace_ids |= {span.trace_id.hex() for span in scope.spans if span.name == "http infer"}
    assert sorted(names) == ["batch", "execute", "http infer", "queue", "receive", "send"]
    assert trace_ids == {TRACE_IDS[0]} and services == {"jitserve"}
