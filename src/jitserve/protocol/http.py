"""The Open Inference Protocol over HTTP/REST, as a bare ASGI application run by uvicorn.

Routes: ``GET /v2/health/live`` (and ``/health``, vLLM's), ``/v2/health/ready``, ``/v2``,
``/v2/models/{m}[/versions/{v}]``, ``/v2/models/{m}[/versions/{v}]/ready``,
Triton's ``/v2/models/{m}[/versions/{v}]/config``, ``/v2/models[/{m}[/versions/{v}]]/stats``,
``POST /v2/repository/index`` (and ``GET /v2/models``, the same list),
``POST /v2/repository/models/{m}/load`` and ``/unload`` (see ``InferenceService.control``),
Triton's shared memory extension (``protocol/shared_memory.py``):
``GET /v2/systemsharedmemory[/region/{r}]/status``,
``POST /v2/systemsharedmemory/region/{r}/register`` and
``POST /v2/systemsharedmemory[/region/{r}]/unregister`` (``cudasharedmemory``
likewise, supported only as far as a server without GPUs answers it),
``POST /v2/models/{m}[/versions/{v}]/infer`` (JSON tensors and the binary
tensor extension that tritonclient uses by default),
``POST /v2/models/{m}[/versions/{v}]/infer_stream`` (the same request; the
outputs come as server-sent events, one ``data:`` JSON response per batch that
ran some of the rows or per step of a streaming serving, an ``event: error``
on failure), Triton's generate extension for generations,
``POST /v2/models/{m}[/versions/{v}]/generate`` and ``/generate_stream`` (a
flat JSON object: the model's inputs by name, e.g. ``text_input``, and its
parameters, top-level or under ``parameters``; the answer's outputs by name,
a text as a string; the stream's as server-sent events), ``GET /metrics``, and OpenAI's API for
text generations and embedding models (``protocol/openai.py``): ``GET /v1/models[/{id}]``,
``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` and vLLM's ``/tokenize`` and
``/detokenize`` (and ``GET /tokenizer_info``), whose errors, 401 included,
are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
Errors are ``{"error": "..."}`` with 400, 404, 408, 413, 431, 503, 504 (500 only when the
model's own function fails); nothing a client sends stops the server. A client that disconnects before
its answer cancels it: its queued rows leave the queue, its generation frees its slot (on jitserve's own
HTTP server; see ``protocol/disconnect.py``).

Why this stack: uvicorn with uvloop (``app.event_loop_factory``) and
httptools is the fastest mainstream Python HTTP server, and a bare ASGI
callable adds no framework routing or validation layers to the hot path.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import orjson

from ..errors import BodyTooLargeError, ProtocolError
from ..serving.request import off_loop
from .access import CORS_METHODS, UNAUTHORIZED, Access, begin_request
from .codec import BFLOAT16, datatype_of, json_values, raw_contents
from .disconnect import CLIENT_GONE, begin_watch, disconnected, unless_gone
from .generate import generate_request, generated
from .http_request import Requested, parse_request, priority
from .limits import Limits
from .metrics import CONTENT_TYPE
from .openai import OpenAIDoor, openai_error
from .openai_request import ROOT_ENDPOINTS, path
from .service import NO_SPAN, InferenceService, NoSpan, loggable, status_of
from .shared_memory import OutputSlot, cuda_register, cuda_status

if TYPE_CHECKING:  # OpenTelemetry is imported only where tracing is configured
    from .tracing import RequestSpan

log = logging.getLogger("jitserve.http")

HEADER_LENGTH = b"inference-header-content-length"
JSON_HEADERS = [(b"content-type", b"application/json")]
COMPRESS_BYTES = 1024  # responses from this size are gzipped for a client that accepts it
ROUTES_REMEMBERED = 1024  # (method, path) -> handler and arguments, found once instead of by regex per request
SEND_CHUNK_BYTES = 256 * 1024  # a large body goes out in pieces, so a slow reader holds one piece in the transport

Response = tuple[int, list[tuple[bytes, bytes]], bytes]
_T = TypeVar("_T")

# dtypes that orjson writes straight from the array's memory (no Python objects per value)
ORJSON_DTYPES = frozenset(np.dtype(name) for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                                      "uint32", "uint64", "float16", "float32", "float64"))
# answered in OpenAI's error shape, 401 and 404 included: /v1/ and vLLM's routes beside it
OPENAI_PATHS = ("/v1/", "/tokenizer_info", *(path(endpoint) for endpoint in ROOT_ENDPOINTS))


def _json(status: int, payload: Any) -> Response:
    return status, JSON_HEADERS, orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _error(status: int, message: str) -> Response:
    status, headers, body = _json(status, {"error": message})
    return status, [*headers, (b"retry-after", b"1")] if status == 503 else headers, body


class _Events:
    """A server-sent events response: the encoded events, sent as they come."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events


Routed = tuple[Callable[..., Awaitable[Response | _Events]], dict[str, Any]]  # a route's handler, its arguments


class HttpFront:
    """The ASGI application."""

    def __init__(self, service: InferenceService, limits: Limits = Limits(), access: Access = Access()) -> None:
        self.service = service
        self.access = access
        self.max_body_bytes = limits.max_body_bytes
        self.offload_bytes = limits.offload_bytes
        self._offloaded = asyncio.Semaphore(1)  # large bodies are decoded/encoded one at a time: bounded memory
        self.openai = OpenAIDoor(service)
        self._routed: dict[tuple[str, str], Routed] = {}
        model = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        memory = r"/v2/(?P<kind>system|cuda)sharedmemory(?:/region/(?P<region>[^/]+))?"
        self.routes: list[tuple[str, re.Pattern[str], Callable[..., Awaitable[Response | _Events]]]] = [
            ("POST", re.compile(model + "/infer"), self.infer),
            ("POST", re.compile(model + "/infer_stream"), self.infer_stream),
            ("POST", re.compile(model + "/generate"), self.generate),
            ("POST", re.compile(model + "/generate_stream"), self.generate_stream),
            ("GET", re.compile(r"/v2/health/live"), self.live),
            ("GET", re.compile(r"/health"), self.live),  # vLLM's and TGI's liveness path, where their probes point
            ("GET", re.compile(r"/v2/health/ready"), self.ready),
            ("GET", re.compile(r"/v2"), self.server_metadata),
            ("GET", re.compile(r"/v2/models/stats"), self.statistics),
            ("GET", re.compile(r"/v2/models"), self.model_list),
            ("POST", re.compile(r"/v2/repository/index"), self.repository_index),
            ("POST", re.compile(r"/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)"),
             self.model_control),
            ("GET", re.compile(model + "/ready"), self.model_ready),
            ("GET", re.compile(model + "/config"), self.model_config),
            ("GET", re.compile(model + "/stats"), self.statistics),
            ("GET", re.compile(model), self.model_metadata),
            ("GET", re.compile(r"/metrics"), self.metrics),
            ("GET", re.compile(r"/v1/models"), self.openai.models),
            ("GET", re.compile(r"/v1/models/(?P<model>[^/]+)"), self.openai.model),
            ("POST", re.compile(r"/v1/(?P<endpoint>completions|chat/completions|embeddings)"), self.openai_request),
            ("POST", re.compile(f"/(?P<endpoint>{'|'.join(ROOT_ENDPOINTS)})"), self.openai_request),  # vLLM's
            ("GET", re.compile(r"/tokenizer_info"), self.openai.tokenizer_info),  # vLLM's too
            ("GET", re.compile(memory + "/status"), self.shared_memory_status),
            ("POST", re.compile(memory + "/(?P<action>register|unregister)"), self.shared_memory_control),
        ]

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        method = scope["method"]
        rid = begin_request(headers.get(b"x-request-id"))  # this request's task only: every line it logs carries it
        begin_watch(scope)
        if method == "OPTIONS":  # a browser's CORS preflight, or a client asking what is allowed
            await _send(send, 204, [(b"allow", CORS_METHODS), *self.access.preflight_headers(headers)], b"", False)
            return
        if not self.access.http_allows(scope["path"], headers):
            status, json_headers, body = openai_error(401, UNAUTHORIZED, None, "invalid_api_key") \
                if scope["path"].startswith(OPENAI_PATHS) else \
                (401, JSON_HEADERS, orjson.dumps({"error": UNAUTHORIZED}))
            response: Response | _Events = (status, [*json_headers, (b"www-authenticate", b"Bearer")], body)
        else:
            try:
                response = await self.route(scope, headers, receive)
            except asyncio.CancelledError:
                if not self.service.draining:
                    raise
                response = _error(503, "the server shut down before this request was answered (its drain "
                                       "timeout passed); retry it on another server")
            except Exception:
                log.exception("unexpected error serving %s %s", method, loggable(scope.get("path", "")))
                response = _error(500, "internal error; the server log has the details")
        answer_headers = [(b"x-request-id", rid.encode()), *self.access.cors_headers(headers)]
        if isinstance(response, _Events):
            await _send_events(response.events, answer_headers, receive, send)
            return
        status, response_headers, body = response
        response_headers = [*response_headers, *answer_headers]
        if len(body) >= COMPRESS_BYTES and b"gzip" in headers.get(b"accept-encoding", b""):
            body = await self._off_loop(len(body), lambda: gzip.compress(body, compresslevel=1))
            response_headers += [(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        await _send(send, status, response_headers, body, method != "HEAD")

    async def route(self, scope: dict[str, Any], headers: dict[bytes, bytes], receive: Callable[..., Any]
                    ) -> Response | _Events:
        method, path = scope["method"], scope["path"]
        method = "GET" if method == "HEAD" else method  # HEAD: GET's status and headers, no body
        found = self._routed.get((method, path)) or self._match(method, path)
        if found is None:
            allowed = [route_method for route_method, pattern, _ in self.routes if pattern.fullmatch(path)]
            refuse = openai_error if path.startswith(OPENAI_PATHS) else _error
            if allowed:
                return refuse(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}")
            return refuse(404, f"no such endpoint: {method} {path}")
        handler, arguments = found
        if method == "POST":
            return await handler(headers, receive, **arguments)
        return await handler(**arguments)

    def _match(self, method: str, path: str) -> Routed | None:
        """The first route of ``method`` whose pattern ``path`` matches, and the arguments it gives, remembered
        for the next request to that path."""
        for route_method, pattern, handler in self.routes:
            match = pattern.fullmatch(path) if route_method == method else None
            if match is not None:
                if len(self._routed) >= ROUTES_REMEMBERED:  # paths naming models that come and go: start afresh
                    self._routed.clear()
                found = self._routed[(method, path)] = (handler, match.groupdict())
                return found
        return None

    async def live(self) -> Response:
        return _json(200, {"live": True})

    async def ready(self) -> Response:
        ready = self.service.ready()
        return _json(200 if ready else 503, {"ready": ready})

    async def server_metadata(self) -> Response:
        return _json(200, self.service.server_metadata())

    async def model_metadata(self, model: str, version: str | None) -> Response:
        return _answer(lambda: self.service.model_metadata(model, version))

    async def model_config(self, model: str, version: str | None) -> Response:
        return _answer(lambda: self.service.model(model, version).config())

    async def statistics(self, model: str | None = None, version: str | None = None) -> Response:
        return _answer(lambda: self.service.statistics(model, version))

    async def model_list(self) -> Response:
        return _json(200, self.service.repository_index())

    async def repository_index(self, headers: dict[bytes, bytes], receive: Callable[..., Any]) -> Response:
        """Triton's repository index; a body ``{"ready": true}`` lists only ready models."""
        try:
            body, _ = await self._read_body(headers, receive)
            options = orjson.loads(body) if body.strip() else {}
        except BodyTooLargeError as error:
            return _error(413, str(error))
        except (ProtocolError, orjson.JSONDecodeError) as error:
            return _error(400, f"the repository index request must be a JSON object: {error}")
        return _json(200, self.service.repository_index(isinstance(options, dict) and options.get("ready") is True))

    async def model_control(self, headers: dict[bytes, bytes], receive: Callable[..., Any], model: str,
                            action: Literal["load", "unload"]) -> Response:
        """Triton's repository ``load`` and ``unload`` of a model, answered once done (see
        ``InferenceService.control``); a body ``{"parameters": {...}}`` as tritonclient sends it."""
        try:
            body, _ = await self._read_body(headers, receive)
            try:
                request = orjson.loads(body) if body.strip() else {}
            except orjson.JSONDecodeError as error:
                raise ProtocolError(f"the {action} request body is not valid JSON: {error}") from None
            if not isinstance(request, dict) or not isinstance(request.get("parameters", {}), dict):
                raise ProtocolError(f'the {action} request must be a JSON object, its "parameters" an object')
            await self.service.load_or_unload(action, model, request.get("parameters"))
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return self._failed(model, error)
        return _json(200, {})

    async def model_ready(self, model: str, version: str | None) -> Response:
        try:
            self.service.model(model, version)
        except Exception as error:  # noqa: BLE001
            return _error(status_of(error)[0], str(error))
        ready = self.service.ready()
        return _json(200 if ready else 503, {"name": model, "ready": ready})

    async def shared_memory_status(self, kind: str, region: str | None) -> Response:
        """Triton's shared memory status: every region, or the one named."""
        status = self.service.shared_memory.status if kind == "system" else cuda_status
        return _answer(lambda: status(region or ""))

    async def shared_memory_control(self, headers: dict[bytes, bytes], receive: Callable[..., Any], kind: str,
                                    region: str | None, action: Literal["register", "unregister"]) -> Response:
        """Triton's shared memory register (a body ``{"key", "offset", "byte_size"}``) and unregister (the
        region named, or every one)."""
        memory = self.service.shared_memory
        try:
            body, _ = await self._read_body(headers, receive)
            if action == "unregister":
                if kind == "system":
                    memory.unregister(region or "")
            elif kind == "cuda":
                cuda_register(region or "")
            else:
                try:
                    request = orjson.loads(body)
                except orjson.JSONDecodeError as error:
                    raise ProtocolError(f"the register request body is not valid JSON: {error}") from None
                if not isinstance(request, dict):
                    raise ProtocolError('the register request must be a JSON object {"key", "offset", "byte_size"}')
                memory.register(region or "", request.get("key"), request.get("offset", 0), request.get("byte_size"))
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return _error(status_of(error)[0], str(error))
        return _json(200, {})

    async def metrics(self) -> Response:
        return 200, [(b"content-type", CONTENT_TYPE.encode())], self.service.metrics.render()

    async def _read_body(self, headers: dict[bytes, bytes], receive: Callable[..., Any]
                         ) -> tuple[bytes, int | None]:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # a half-close before the whole body: nothing runs
                raise ProtocolError(f"the client closed the connection after {size} bytes of the body"
                                    f"{'' if declared is None else f' of {int(declared)}'}; nothing ran")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(size, self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        header_length = headers.get(HEADER_LENGTH)
        if header_length is not None and not header_length.isdigit():
            raise ProtocolError(f"Inference-Header-Content-Length must be a number of bytes, got {header_length!r}")
        body = b"".join(chunks)
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding != b"identity":
            body = await self._off_loop(len(body), lambda: _decompress(body, encoding, self.max_body_bytes))
        return body, None if header_length is None else int(header_length)

    async def infer(self, headers: dict[bytes, bytes], receive: Callable[..., Any], model: str,
                    version: str | None) -> Response:
        span = self.service.span("http", model, headers.items)
        try:
            body, header_length = await self._read_body(headers, receive)
            parse = functools.partial(parse_request, body, header_length, self.service.shared_memory)
            # a small body is decoded (and its answer encoded) here, without the coroutine of _off_loop
            request, tensors, requested, binary_outputs = parse() if len(body) < self.offload_bytes \
                else await self._off_loop(len(body), parse)
            span.phase("receive")
            answered = await unless_gone(self.service.infer(model, tensors, _classes(requested), priority(request),
                                                            version, request.get("parameters")))
            if answered is None:  # counted and traced as nginx logs it, never sent
                self.service.count(model, "http", CLIENT_GONE[0], version)
                span.end(status=CLIENT_GONE[0])
                return CLIENT_GONE
            served, outputs = answered
            span.phase(None)  # the queue and batch spans come from the batches
            size = sum([array.nbytes for _, array in outputs])
            encode = functools.partial(_encode_response, model, served, request.get("id"), outputs, _how(requested),
                                       binary_outputs)
            response = encode() if size < self.offload_bytes else await self._off_loop(size, encode)
        except Exception as error:  # noqa: BLE001 - statuses by error class; the model's own failure is a 500
            failed = self._failed(model, error, version)
            span.end(error, failed[0])
            return failed
        self.service.count(model, "http", 200, served)
        span.phase("send")
        span.end(status=200)
        return response

    async def _off_loop(self, size: int, work: Callable[[], _T]) -> _T:
        """``work()`` (decoding or encoding a body of about ``size`` bytes): here when small; when large, on a
        thread, one at a time (see :func:`~jitserve.serving.request.off_loop`)."""
        return await off_loop(size, work, self.offload_bytes, self._offloaded)

    def _failed(self, model: str, error: BaseException, version: str | None = None) -> Response:
        status, _, message = self.service.failed("http", model, error, version)
        return _error(status, message)


    async def infer_stream(self, headers: dict[bytes, bytes], receive: Callable[..., Any], model: str,
                           version: str | None) -> Response | _Events:
        """The request is read, checked and queued first (its errors are ordinary 4xx/5xx responses); then
        the outputs go out as events while the rows run."""
        span = self.service.span("http", model, headers.items, "infer_stream")
        try:
            body, header_length = await self._read_body(headers, receive)
            request, tensors, requested, _ = await self._off_loop(
                len(body), lambda: parse_request(body, header_length, self.service.shared_memory))
            span.phase("receive")
            served, stream = await self.service.infer_stream(model, tensors, _classes(requested),
                                                       priority(request), version, request.get("parameters"))
        except Exception as error:  # noqa: BLE001 - statuses by error class
            failed = self._failed(model, error, version)
            span.end(error, failed[0])
            return failed
        slots = {name: (None, slot) for name, (_, slot) in _how(requested).items()}  # events are JSON
        return _Events(self._events(model, served, request.get("id"), stream, span,
                                    lambda name, version, request_id, outputs: _encode_response(
                                        name, version, request_id, outputs, slots, False)[2]))

    async def generate(self, headers: dict[bytes, bytes], receive: Callable[..., Any], model: str,
                       version: str | None) -> Response:
        """Triton's generate extension: one JSON answer with the whole generation."""
        try:
            body, _ = await self._read_body(headers, receive)
            request_id, tensors, parameters = generate_request(body, self.service.model(model, version), False)
            answered = await unless_gone(self.service.infer(model, tensors, None, None, version, parameters), receive)
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return self._failed(model, error, version)
        if answered is None:
            return CLIENT_GONE
        served, outputs = answered
        self.service.count(model, "http", 200, served)
        return 200, JSON_HEADERS, generated(model, served, request_id, outputs)

    async def generate_stream(self, headers: dict[bytes, bytes], receive: Callable[..., Any], model: str,
                              version: str | None) -> Response | _Events:
        """Triton's generate extension, streamed: one server-sent event per step, as :meth:`generate`'s."""
        try:
            body, _ = await self._read_body(headers, receive)
            request_id, tensors, parameters = generate_request(body, self.service.model(model, version), True)
            served, stream = await self.service.infer_stream(model, tensors, None, None, version, parameters)
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return self._failed(model, error, version)
        return _Events(self._events(model, served, request_id, stream, NO_SPAN, generated))

    async def openai_request(self, headers: dict[bytes, bytes], receive: Callable[..., Any],
                             endpoint: str) -> Response | _Events:
        """OpenAI's ``POST /v1/{endpoint}`` or vLLM's ``/tokenize`` and ``/detokenize`` (``protocol/openai.py``):
        the answer, or its stream's events."""
        try:
            body, _ = await self._read_body(headers, receive)
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return self.openai.refused("", error)
        answer = await unless_gone(self.openai.post(endpoint, body), receive)
        if answer is None:
            return CLIENT_GONE
        return answer if isinstance(answer, tuple) else _Events(answer)

    async def _events(self, model: str, served: str, request_id: Any,
                      stream: AsyncIterator[list[tuple[str, np.ndarray]]], span: RequestSpan | NoSpan,
                      encode: Callable[[str, str, Any, list[tuple[str, np.ndarray]]], bytes]) -> AsyncIterator[bytes]:
        """Each of ``stream``'s outputs as an event, encoded by ``encode``."""
        failure: BaseException | None = None
        status: int | str = "disconnected"  # unless it ends or fails
        try:
            async for outputs in stream:
                span.output()
                yield b"data: " + encode(model, served, request_id, outputs) + b"\n\n"
            status = 200
        except Exception as error:  # noqa: BLE001 - the stream has started: the error is its last event
            failure = error
            status, _, message = self.service.failed("http", model, error, served)
            yield b"event: error\ndata: " + orjson.dumps({"error": message, "status": status}) + b"\n\n"
            return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            span.phase("stream")
            span.end(failure, status)
        self.service.count(model, "http", 200, served)


async def _send_events(events: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]], receive: Callable[..., Any],
                       send: Callable[..., Any]) -> None:
    """Send each event as it comes, after ``headers`` (the request id, CORS); a client that disconnects ends
    the stream (its queued rows are freed)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers]})
    watcher = asyncio.ensure_future(disconnected(receive))
    try:
        while True:
            following = asyncio.ensure_future(anext(events))
            await asyncio.wait({following, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():  # gone: stop waiting for rows nobody will read
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
                return
            try:
                event = following.result()
            except StopAsyncIteration:
                break
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()
        await events.aclose()  # type: ignore[attr-defined]


async def _send(send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                with_body: bool) -> None:
    """One response; a large body in pieces, so that a slow reader holds one piece in the transport."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    if not with_body or len(body) <= SEND_CHUNK_BYTES:
        await send({"type": "http.response.body", "body": body if with_body else b""})
        return
    view = memoryview(body)
    for start in range(0, len(body), SEND_CHUNK_BYTES):
        end = start + SEND_CHUNK_BYTES
        await send({"type": "http.response.body", "body": view[start:end], "more_body": end < len(body)})


def _decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    """A request body sent with ``Content-Encoding`` gzip or deflate, refused once it inflates past ``limit``
    (a small bomb cannot take the memory)."""
    wbits = {b"gzip": 31, b"x-gzip": 31, b"deflate": 15}.get(encoding)
    if wbits is None:
        raise ProtocolError(f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; send gzip, "
                            f"deflate or identity")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise ProtocolError(f"the body is not valid {encoding.decode()} data: {error}") from None
    if len(data) > limit:
        raise _too_large(len(data), limit)
    if not inflater.eof:
        raise ProtocolError(f"the {encoding.decode()} body ends before its compressed stream does")
    return data


def _answer(make: Callable[[], Any]) -> Response:
    """``make()`` as a 200 JSON response, or its error's status and message."""
    try:
        return _json(200, make())
    except Exception as error:  # noqa: BLE001 - statuses by error class
        return _error(status_of(error)[0], str(error))


def _too_large(size: int, limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"request body of {size} bytes exceeds the limit of {limit} bytes")


def _classes(requested: list[Requested]) -> dict[str, int] | None:
    """The outputs a request asks for, each with its classification count (0: the tensor), or None for all."""
    return {name: classes for name, _, classes, _ in requested} or None


def _how(requested: list[Requested]) -> dict[str, tuple[bool | None, OutputSlot | None]]:
    """How each output a request names goes back: binary or not (None: the request's default), or into
    shared memory."""
    return {name: (binary, slot) for name, binary, _, slot in requested}


def _json_data(array: np.ndarray) -> Any:
    """A tensor's ``data`` for orjson: the flat array itself where orjson writes it from memory (a native
    dtype; a float's NaN and infinities it writes as null, which :func:`_encode_response` looks for
    afterwards), else the values as JSON-safe Python objects (non-finite floats as strings)."""
    flat = array.reshape(-1)  # C-contiguous: a view of a contiguous array, else a copy
    if flat.dtype == BFLOAT16:  # each value exactly a float32, which orjson writes from memory
        flat = flat.astype(np.float32)
    return flat if flat.dtype in ORJSON_DTYPES else json_values(flat)


def _encode_response(model: str, version: str, request_id: Any, outputs: list[tuple[str, np.ndarray]],
                     how: Mapping[str, tuple[bool | None, OutputSlot | None]], binary_all: bool) -> Response:
    """The answer: each output as JSON data, binary data after the JSON, or written into its shared memory
    slot (then without data, as Triton answers it)."""
    described, blobs = [], []
    floats = []  # the entries whose float data orjson writes from memory: a NaN or an infinity would be null
    for name, array in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        as_binary, slot = how.get(name, (None, None))
        if slot is not None:
            slot.write(array)
        elif as_binary if as_binary is not None else binary_all:
            blob = raw_contents(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            data = entry["data"] = _json_data(array)
            if type(data) is np.ndarray and data.dtype.kind == "f":
                floats.append(entry)
        described.append(entry)
    payload: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": described}
    if request_id is not None:
        payload["id"] = request_id
    header = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    if floats and b"null" in header:  # maybe a non-finite float: each float output's values as JSON-safe ones
        for entry in floats:
            entry["data"] = json_values(entry["data"])
        header = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return 200, JSON_HEADERS, header
    headers = [(b"content-type", b"application/octet-stream"), (HEADER_LENGTH, str(len(header)).encode())]
    return 200, headers, b"".join([header, *blobs])

