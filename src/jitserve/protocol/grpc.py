"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService``.

The servicer, its bidirectional stream and the server. The messages, and an
inference request read into tensors and answered, are ``protocol/grpc_request.py``'s.
The server is ``grpc.aio`` on an event loop of its own thread; inference goes
through the same servers as HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ..errors import ProtocolError
from .access import REQUEST_ARRIVED, Access, ApiKeyInterceptor, begin_request
from .codec import shown
from .grpc_request import (
    MESSAGES,
    POOL,
    SERVICE,
    decode_inputs,
    flag,
    infer_response,
    parameter_values,
    parse,
    parse_infer,
    priority,
    requested_outputs,
)
from .limits import Limits, Tls
from .service import NO_SPAN, InferenceService, NoSpan, status_of
from .shared_memory import CALLS

if TYPE_CHECKING:  # OpenTelemetry is imported only where tracing is configured
    from .tracing import RequestSpan

log = logging.getLogger("jitserve.grpc")

HEALTH_SERVICE = "grpc.health.v1.Health"
PENDING_CALLS = 1_000_000
QUIET_SECONDS = 0.1  # at shutdown, gRPC core stops once no accepted inference call has run for this long
DRAINING = "the server is shutting down and takes no new requests; retry on another server"


class GrpcFront:
    """The servicer: one coroutine per RPC."""

    def __init__(self, service: InferenceService, limits: Limits = Limits()) -> None:
        self.service = service
        self.limits = limits
        self.streams: set[StreamCall] = set()
        self.calls = 0  # inference calls in flight, and requests of streams
        self.last_call = 0.0  # loop time an inference call last ended

    async def quiet(self, seconds: float, deadline: float) -> None:
        """Return once no accepted inference call has been in flight for ``seconds`` (or at loop time
        ``deadline``)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline and (self.calls or loop.time() - self.last_call < seconds):
            await asyncio.sleep(seconds / 10)

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - protocol names
        return MESSAGES["ServerLiveResponse"](live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return MESSAGES["ServerReadyResponse"](ready=self.service.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        def ready() -> dict[str, Any]:
            self.service.model(request.name, request.version)  # an unknown model or version is NOT_FOUND
            return {"ready": self.service.ready()}

        return await _answer(context, "ModelReadyResponse", ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return MESSAGES["ServerMetadataResponse"](**self.service.server_metadata())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await _answer(context, "ModelMetadataResponse",
                             lambda: self.service.model_metadata(request.name, request.version))

    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await _answer(context, "ModelConfigResponse",
                             lambda: {"config": self.service.model(request.name, request.version).config()})

    async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await _answer(context, "ModelStatisticsResponse",
                             lambda: self.service.statistics(request.name, request.version))

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await _answer(context, "RepositoryIndexResponse",
                             lambda: {"models": self.service.repository_index(request.ready)})

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._control("load", request, context, "RepositoryModelLoadResponse")

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._control("unload", request, context, "RepositoryModelUnloadResponse")

    async def _control(self, action: str, request: Any, context: Any, response: str) -> Any:
        """A repository load or unload, answered once done (see ``InferenceService.load_or_unload``)."""
        try:
            await self.service.load_or_unload(action, request.model_name, parameter_values(request.parameters))
        except Exception as error:  # noqa: BLE001 - statuses by error class
            _, status, message = self.service.failed("grpc", request.model_name, error)
            await context.abort(getattr(grpc.StatusCode, status), message)
        return MESSAGES[response]()

    async def shared_memory(self, method: str, request: Any, context: Any) -> Any:
        """One of Triton's shared memory calls (``shared_memory.CALLS``)."""
        return await _answer(context, f"{method}Response",
                             lambda: CALLS[method](self.service.shared_memory, request) or {})

    async def ModelInfer(self, request: Any, context: Any,  # noqa: N802
                         raw: list[memoryview] | None = None) -> Any:
        """``raw``: the request's raw contents as :func:`parse_infer` read them, if it did."""
        model = request.model_name
        if self.service.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        self.calls += 1  # what ``quiet`` waits on at a shutdown
        span = self.service.span("grpc", model, lambda: context.invocation_metadata() or ())
        try:
            tensors = decode_inputs(request, self.service.shared_memory, raw)
            names, slots = requested_outputs(request, self.service.shared_memory) if request.outputs else (None, {})
            span.phase("receive")
            given = request.parameters  # each read of the field makes a new wrapper
            level, parameters = (priority(given), parameter_values(given)) if given else (None, None)
            served, outputs = await self.service.infer(model, tensors, names, level, request.model_version,
                                                       parameters)
            span.phase(None)  # the queue and batch spans come from the batches
            response = infer_response(model, served, request.id, outputs, slots)
        except Exception as error:  # noqa: BLE001 - statuses by error class; the model's own failure is INTERNAL
            _, status, message = self.service.failed("grpc", model, error, request.model_version)
            span.end(error, status)
            await context.abort(getattr(grpc.StatusCode, status), message)
        finally:
            self.calls -= 1
            self.last_call = asyncio.get_running_loop().time()
        self.service.count(model, "grpc", "OK", served)
        span.phase("send")
        span.end(status="OK")
        return response

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """Triton's bidirectional stream (tritonclient's ``start_stream`` / ``async_stream_infer``): each
        request is answered with one response per batch that ran some of its rows (per step of a
        streaming serving), as they are ready; errors come as ``error_message``, with the request's id. A
        request that asks for ``triton_enable_empty_final_response`` (as perf_analyzer's do) gets Triton's
        decoupled protocol: each response marked ``triton_final_response`` false, then a last, empty one
        marked true. Bounded as :class:`StreamCall` says."""
        _tag_request(context)
        call = StreamCall(self, context)
        self.streams.add(call)
        try:
            async for response in call.responses(requests):
                yield response
        finally:
            self.streams.discard(call)

    def drain(self) -> None:
        """At shutdown: every open stream answers what it has accepted, refuses what comes after, and ends."""
        for call in list(self.streams):
            call.drain()


class StreamCall:
    """One ``ModelStreamInfer`` call under the server's limits. At most ``max_stream_requests`` of its requests
    are in flight: beyond, the stream is not read, and HTTP/2 flow control holds the client back. Replies wait
    for the client in a buffer of ``stream_buffer_bytes``: beyond, the requests that produce them wait. So
    one stream holds at most the buffer and one reply per request in flight. A client that reads nothing
    for ``write_timeout`` seconds while replies wait is cut off (UNAVAILABLE) and all of it freed. At
    shutdown the stream refuses new requests (with ``DRAINING``), answers those in flight, and ends.
    (gRPC cannot end a call while it holds a reply the client has not read: that one reply, and the
    descriptor, stay until the client reads or goes away; ``max_grpc_connections`` bounds those.)"""

    def __init__(self, front: GrpcFront, context: Any) -> None:
        self.front = front
        self.context = context
        self.limits = front.limits
        self.replies: asyncio.Queue[Any] = asyncio.Queue()  # (message, bytes), or None at the end
        self.buffered = 0  # bytes of the replies waiting
        self.room = asyncio.Condition()  # notified as replies leave the buffer
        self.slots = asyncio.Semaphore(self.limits.max_stream_requests)
        self.running: set[asyncio.Task[None]] = set()
        self.sending_since: float | None = None  # loop time the reply being sent was handed to gRPC
        self.draining = False
        self.cut_off: str | None = None  # why the server ended the stream, once it has
        self.reader: asyncio.Future[None] | None = None  # the task that reads the requests, once started

    async def responses(self, requests: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        reader = self.reader = asyncio.ensure_future(self._read(requests))
        watchdog = asyncio.ensure_future(self._watch())
        try:
            while (reply := await self.replies.get()) is not None:
                message, size = reply
                self.sending_since = loop.time()
                yield message
                self.sending_since = None
                async with self.room:
                    self.buffered -= size
                    self.room.notify_all()
            if self.cut_off is not None:
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, self.cut_off)
            if self.draining and not reader.done():  # ended by the shutdown, not by the client
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        finally:  # the client went away (or finished): its queued rows leave the queues
            for task in (reader, watchdog, *self.running):
                task.cancel()

    def drain(self) -> None:
        self.draining = True
        if not self.running:
            self.replies.put_nowait(None)

    async def _read(self, requests: Any) -> None:
        async for data in requests:
            await self.slots.acquire()
            if self.draining:
                self.slots.release()
                request = _parsed_or_none(data)
                await self._put(_stream_error(request, getattr(request, "model_name", ""), DRAINING))
                continue
            task = asyncio.ensure_future(self._answer(data))
            self.running.add(task)
            self.front.calls += 1
            task.add_done_callback(self._answered)
        while self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)
        await self.replies.put(None)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.slots.release()
        self.front.calls -= 1
        self.front.last_call = asyncio.get_running_loop().time()
        if self.draining and not self.running:
            self.replies.put_nowait(None)

    async def _put(self, message: Any) -> None:
        """Queue a reply once the buffer has room (a reply larger than the buffer goes alone)."""
        size = message.ByteSize()
        async with self.room:
            await self.room.wait_for(lambda: self.buffered < self.limits.stream_buffer_bytes)
            self.buffered += size
        self.replies.put_nowait((message, size))

    async def _answer(self, data: bytes) -> None:
        REQUEST_ARRIVED.set(time.perf_counter())  # this request's task: its latency in the access log
        service = self.front.service
        model = ""
        request = failure = stream = None
        span: RequestSpan | NoSpan = NO_SPAN
        status = "CANCELLED"  # unless it ends or fails
        try:
            request, raw = parse_infer(data)
            model = request.model_name
            span = service.span("grpc", model, lambda: self.context.invocation_metadata() or (), "stream infer")
            tensors = decode_inputs(request, service.shared_memory, raw)
            names, slots = requested_outputs(request, service.shared_memory)
            span.phase("receive")
            served, stream = await service.infer_stream(model, tensors, names, priority(request.parameters),
                                                        request.model_version, parameter_values(request.parameters))
            marked = flag(request, "triton_enable_empty_final_response")  # so the last one tells it is
            async for outputs in stream:
                span.output()
                # made in place: a local reply kept across the await would hold each waiting reply twice
                reply = MESSAGES["ModelStreamInferResponse"](
                    infer_response=infer_response(model, served, request.id, outputs, slots))
                if marked:
                    reply.infer_response.parameters["triton_final_response"].bool_param = False
                await self._put(reply)
            status = "OK"
        except Exception as error:  # noqa: BLE001 - answered on the stream, which stays open
            failure = error
            version = None if request is None else request.model_version
            _, status, message = service.failed("grpc", model, error, version)
            await self._put(_stream_error(request, model, message))
            return
        finally:
            span.phase(None if stream is None else "stream")
            span.end(failure, status)
        service.count(model, "grpc", "OK", served)
        if marked:
            final = MESSAGES["ModelInferResponse"](model_name=model, model_version=served, id=request.id)
            final.parameters["triton_final_response"].bool_param = True
            await self._put(MESSAGES["ModelStreamInferResponse"](infer_response=final))

    async def _watch(self) -> None:
        """Cut the stream off once a reply has waited ``write_timeout`` seconds for a client that does not
        read (as HTTP's ``--write-timeout``): its requests are cancelled, its replies freed, it is read no
        more."""
        loop = asyncio.get_running_loop()
        timeout = self.limits.write_timeout
        while True:
            await asyncio.sleep(timeout / 4)
            since = self.sending_since
            if since is not None and loop.time() - since >= timeout:
                break
        log.warning("a gRPC stream's client stopped reading its replies for %g s (--write-timeout): stream "
                    "ended, %d requests in flight cancelled", timeout, len(self.running))
        self.cut_off = f"the client did not read its replies for {timeout:g} s (--write-timeout)"
        for task in (self.reader, *self.running):
            if task is not None:
                task.cancel()
        while not self.replies.empty():
            self.replies.get_nowait()
        self.replies.put_nowait(None)  # gRPC holds the reply being sent; once it is read, the call ends


def _parsed_or_none(data: bytes) -> Any:
    try:
        return parse(MESSAGES["ModelInferRequest"], data)
    except ProtocolError:
        return None


def _stream_error(request: Any, model: str, message: str) -> Any:
    """A stream's error reply: ``error_message``, and the request's id in ``infer_response`` as Triton sends
    it (tritonclient shows only the message, so it names the id too)."""
    request_id = "" if request is None else request.id
    if request_id:
        message = f"request '{shown(request_id)}': {message}"
    return MESSAGES["ModelStreamInferResponse"](
        error_message=message, infer_response=MESSAGES["ModelInferResponse"](model_name=model, id=request_id))


async def _answer(context: Any, response: str, make: Callable[[], dict[str, Any]]) -> Any:
    """The response message ``response`` with the fields of ``make()``, or the call aborted with its error's
    status and message."""
    try:
        fields = make()
    except Exception as error:  # noqa: BLE001 - statuses by error class
        await context.abort(getattr(grpc.StatusCode, status_of(error)[1]), str(error))
    return json_format.ParseDict(fields, MESSAGES[response]())


def _parsing(handler: Callable[..., Any], parse_request: Callable[[bytes], tuple[Any, ...]]
             ) -> Callable[[bytes, Any], Any]:
    """A handler of the request's bytes: ``handler(request, context, *more)`` with what ``parse_request`` reads
    from them, ``(request, *more)``; bytes that are no such request are INVALID_ARGUMENT."""
    async def parsed(data: bytes, context: Any) -> Any:
        _tag_request(context)
        try:
            request, *more = parse_request(data)
        except ProtocolError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return await handler(request, context, *more)

    return parsed


def _parsed_as(request_class: Any) -> Callable[[bytes], tuple[Any]]:
    return lambda data: (parse(request_class, data),)


def _tag_request(context: Any) -> None:
    """This call's request id (the client's ``x-request-id`` metadata, else a new one) on its log lines."""
    begin_request(dict(context.invocation_metadata() or ()).get("x-request-id"))


def _handlers(front: GrpcFront) -> grpc.GenericRpcHandler:
    pool = {}
    for method in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                   "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
                   "RepositoryModelUnload"):
        parser = parse_infer if method == "ModelInfer" else _parsed_as(MESSAGES[f"{method}Request"])
        pool[method] = grpc.unary_unary_rpc_method_handler(
            _parsing(getattr(front, method), parser),
            response_serializer=MESSAGES[f"{method}Response"].SerializeToString)
    for method in CALLS:
        pool[method] = grpc.unary_unary_rpc_method_handler(
            _parsing(functools.partial(front.shared_memory, method), _parsed_as(MESSAGES[f"{method}Request"])),
            response_serializer=MESSAGES[f"{method}Response"].SerializeToString)
    pool["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        front.ModelStreamInfer, response_serializer=MESSAGES["ModelStreamInferResponse"].SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, pool)


class GrpcServer:
    """``grpc.aio`` on its own thread and event loop; ``start`` binds, ``stop`` drains and ends it."""

    def __init__(self, service: InferenceService, host: str, port: int, limits: Limits, access: Access = Access(),
                 tls: Tls | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jitserve-grpc", daemon=True)
        options = [("grpc.max_receive_message_length", limits.max_body_bytes),
                   ("grpc.max_send_message_length", limits.max_body_bytes),
                   ("grpc.so_reuseport", 0),  # a second server on this port fails instead of sharing it
                   # gRPC core cancels calls its application has not yet taken beyond 1,000 pending (randomly up
                   # to 3,000): a burst gets CANCELLED. Let every call through to maximum_concurrent_rpcs, which
                   # refuses the excess with RESOURCE_EXHAUSTED, a status clients know to back off on.
                   ("grpc.server.max_pending_requests", PENDING_CALLS),
                   ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
                   # descriptors: connections are counted from accept (one more is closed at once), and one
                   # must finish its TCP+TLS+HTTP/2 handshake within the read timeout (gRPC core's default is
                   # 120 s) and is closed (GOAWAY) after idle_timeout seconds without a call
                   ("grpc.max_allowed_incoming_connections", limits.max_grpc_connections),
                   ("grpc.server_handshake_timeout_ms", max(1, int(limits.read_timeout * 1000))),
                   ("grpc.max_connection_idle_ms", max(1, int(limits.idle_timeout * 1000)))]
        self._server: Any = None
        self._address = f"{host}:{port}"
        interceptors = [ApiKeyInterceptor(access)] if access.api_key is not None else []
        self._build: Callable[[], Any] = lambda: grpc.aio.server(
            options=options, maximum_concurrent_rpcs=limits.max_grpc_calls, interceptors=interceptors)
        self._tls = tls
        self._front = GrpcFront(service, limits)
        self._health: Any = None
        self._stopping: Any = None  # the future of the server's stop, once begun
        self.port = port

    def start(self) -> None:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self) -> int:
        self._server = self._build()
        self._server.add_generic_rpc_handlers((_handlers(self._front),))
        self._health = health_aio.HealthServicer()
        await self._serving(self._front.service.ready())
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection([SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME], self._server,
                                            pool=POOL)
        if self._tls is None:
            port = self._server.add_insecure_port(self._address)
        else:
            credentials = grpc.ssl_server_credentials([(self._tls.key_bytes(), self._tls.cert_bytes())])
            port = self._server.add_secure_port(self._address, credentials)
        await self._server.start()
        return port

    async def _serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):  # "" is the whole server, as grpc_health_probe asks by default
            await self._health.set(name, status)

    def opened(self) -> None:
        """The server became ready after it started (its HTTP front processes all listen): health says SERVING."""
        asyncio.run_coroutine_threadsafe(self._serving(True), self._loop).result()

    def begin_stop(self, grace: float) -> None:
        """Stop accepting calls now (new ones are refused UNAVAILABLE; health says NOT_SERVING); calls in
        flight have ``grace`` seconds to finish. Returns at once; a second call changes nothing."""
        if self._server is not None and self._stopping is None:
            self._stopping = asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)

    async def _stop(self, grace: float) -> None:
        """Refuse new inference calls in the handler (UNAVAILABLE) until the calls accepted before are answered
        and a moment has passed without one, then stop gRPC core. Core answers calls it holds but has not yet
        handed to the application CANCELLED when it stops (grpc/grpc#41785): this way the callers of the last
        answered calls have been told UNAVAILABLE first. Refused calls do not delay the stop, so a client
        that keeps calling may still meet that race, once."""
        await self._health.enter_graceful_shutdown()
        self._front.drain()
        deadline = self._loop.time() + grace
        await self._front.quiet(QUIET_SECONDS, deadline)
        await self._server.stop(max(0.0, deadline - self._loop.time()))

    def stop(self, grace: float = 30.0) -> None:
        """``begin_stop`` if it has not begun, wait for the calls in flight, and end the thread."""
        self.begin_stop(grace)
        if self._stopping is not None:
            self._stopping.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
