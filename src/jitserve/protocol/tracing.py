"""OpenTelemetry traces of inference requests, made and exported only when configured (``--trace-endpoint``).

Each inference request (HTTP infer, gRPC ModelInfer) is a span ``http infer`` /
``grpc infer`` (kind SERVER), the child of the request's W3C ``traceparent``
(HTTP header or gRPC metadata) when it carries one, with children ``receive``
(reading and decoding it), ``queue`` (from submission until the batch that
runs its rows formed; one per batch, for a request split across several) and
``send`` (encoding the answer). A streamed request (HTTP ``infer_stream``, each
request of a gRPC ``ModelStreamInfer``: a streaming serving's or a
generation's) is a span ``http infer_stream`` / ``grpc stream infer`` with
children ``receive`` and ``stream`` (from queued to its last output sent), an
event ``first output``, and its outputs counted (``jitserve.outputs``).

Each batch is a span ``batch`` (from forming to delivery) with a child
``execute`` (the compiled call), in a trace of its own and linked to the span
of every request it ran: a batch serves many traces, as OpenTelemetry's links
are meant for. The serving layer knows nothing of this:
a request carries its span's context (``serving.request.TRACE``) into the
reports of its batches, from which the batch listener here makes the spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..serving.partition import BatchReport
from ..serving.request import TRACE
from ..version import __version__

_MONOTONIC_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()
_PROPAGATOR = TraceContextTextMapPropagator()
CARRIED = ("traceparent", "tracestate")  # the W3C trace context headers (gRPC metadata keys alike)


def _epoch_ns(monotonic_s: float) -> int:
    return _MONOTONIC_TO_EPOCH_NS + int(monotonic_s * 1e9)


class Tracing:
    """Makes the spans of requests and batches with ``provider``'s tracer."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("jitserve", __version__)

    @classmethod
    def exporting_to(cls, endpoint: str) -> Tracing:
        """Spans batched and sent to an OTLP/HTTP collector at ``endpoint`` (``http://host:4318/v1/traces``)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": "jitserve"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is left (a provider of the SDK; another is the caller's to shut down)."""
        if isinstance(self.provider, TracerProvider):
            self.provider.shutdown()

    def request(self, protocol: str, model: str, carrier: Iterable[tuple[str | bytes, str | bytes]],
                call: str = "infer") -> RequestSpan:
        """Open the span of a request to ``call`` (its parent from ``carrier``'s W3C headers, if any) and make
        it the current task's trace context, which the request's batches will see."""
        headers = {_text(key).lower(): _text(value) for key, value in carrier if _text(key).lower() in CARRIED}
        span = self.tracer.start_span(f"{protocol} {call}", context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER,
                                      attributes={"rpc.system": protocol, "jitserve.model": model})
        TRACE.set(span.get_span_context())
        return RequestSpan(self.tracer, span)

    def step(self, kind: str, seconds: float) -> None:
        """A generation's steps have no spans of their own: its requests' spans cover them."""

    def batch(self, report: BatchReport) -> None:
        """A front's batch listener (see :class:`~jitserve.serving.front.Listener`): the batch's spans, and
        the queue span of every traced request in it."""
        traced = [(context, wait) for context, wait in zip(report.traces, report.queue_waits_s) if context is not None]
        if not traced:
            return
        formed = _epoch_ns(report.formed_at)
        for context, wait in traced:
            self.tracer.start_span("queue", context=set_span_in_context(NonRecordingSpan(context)),
                                   start_time=formed - int(wait * 1e9)).end(end_time=formed)
        attributes = {"jitserve.model": report.server, "jitserve.batch.rows": report.size,
                      "jitserve.batch.padded_rows": report.padded_size, "jitserve.partition": report.partition}
        batch = self.tracer.start_span("batch", context=Context(), links=[Link(context) for context, _ in traced],
                                       start_time=formed, attributes=attributes)
        execute = self.tracer.start_span("execute", context=set_span_in_context(batch), start_time=formed)
        if report.error is not None:
            execute.set_status(Status(StatusCode.ERROR, str(report.error)[:200]))
        execute.end(end_time=formed + int(report.execution_s * 1e9))
        batch.end()


class RequestSpan:
    """A request's span while it is handled: :meth:`phase` closes a child span from the last mark to now."""

    __slots__ = ("tracer", "span", "context", "mark", "outputs")

    def __init__(self, tracer: Any, span: Any) -> None:
        self.tracer = tracer
        self.span = span
        self.context = set_span_in_context(span)
        self.mark = time.time_ns()
        self.outputs = 0  # a stream's, sent so far

    def output(self) -> None:
        """A stream sent an output: the first is an event, and all are counted at the end."""
        self.outputs += 1
        if self.outputs == 1:
            self.span.add_event("first output")

    def phase(self, name: str | None) -> None:
        """A child span ``name`` from the last mark to now (None: only move the mark)."""
        now = time.time_ns()
        if name is not None:
            self.tracer.start_span(name, context=self.context, start_time=self.mark).end(end_time=now)
        self.mark = now

    def end(self, error: BaseException | None = None, status: int | str | None = None) -> None:
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {str(error)[:200]}"))
        if status is not None:
            self.span.set_attribute("jitserve.status", str(status))
        if self.outputs:
            self.span.set_attribute("jitserve.outputs", self.outputs)
        self.span.end()


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value
