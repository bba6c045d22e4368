"""Who is calling, who may, and what they got: each request's id, an optional API key (HTTP and gRPC), the
browser origins CORS admits, and the access log.

A request's id is the client's ``X-Request-ID`` (HTTP header or gRPC metadata)
when it sends one, else a fresh one; the fronts set it (:func:`begin_request`)
for the time the request is handled, every line logged meanwhile carries it,
and HTTP responses echo it.

The access log (``--access-log``) is one line per inference request, on the
``jitserve.access`` logger: its id, model, version, protocol, status, rows and
latency from arrival, as text or as the fields of a JSON line.

The key and CORS are off unless asked for. With a key, every call carries ``Authorization:
Bearer KEY`` (HTTP header or gRPC metadata; ``X-API-Key: KEY`` is accepted
over HTTP too), else it is answered 401 / UNAUTHENTICATED; health checks
(``/v2/health/*`` and ``/health``, ``grpc.health.v1``, KServe's ``ServerLive`` and
``ServerReady``) stay open so that probes need no secret. Keys are compared in constant time.
"""

from __future__ import annotations

import contextvars
import hmac
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ..errors import OptionError

OPEN_HTTP_PREFIXES = ("/v2/health/", "/health")  # health: KServe's, and vLLM's path
OPEN_GRPC = ("/grpc.health.v1.", "/inference.GRPCInferenceService/ServerLive",
             "/inference.GRPCInferenceService/ServerReady")  # health, as HTTP's /v2/health/*
UNAUTHORIZED = "this server needs an API key: send the header 'Authorization: Bearer <key>'"
CORS_METHODS = b"GET, POST, HEAD, OPTIONS"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("jitserve_request_id", default=None)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_ID_PREFIX = os.urandom(4).hex()  # this process's: ids of several servers do not collide
_ID_COUNTER = itertools.count(1)  # then a counter: no system call per request, as uuid4 makes


REQUEST_ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("jitserve_request_arrived", default=0.0)
REQUEST_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("jitserve_request_rows", default=0)
ACCESS_LOG = logging.getLogger("jitserve.access")


def begin_request(given: str | bytes | None) -> str:
    """Tag the current task with a request's id (see :func:`request_id`) and its arrival; returns the id."""
    rid = request_id(given)
    REQUEST_ID.set(rid)
    REQUEST_ARRIVED.set(time.perf_counter())
    return rid


def log_access(model: str, version: str | None, protocol: str, status: int | str) -> None:
    """The access log's line for the current request, answered with ``status``."""
    fields = {"request_id": REQUEST_ID.get(), "model": model, "version": version or "", "protocol": protocol,
              "status": status, "rows": REQUEST_ROWS.get(),
              "latency_ms": round((time.perf_counter() - REQUEST_ARRIVED.get()) * 1000, 3)}
    ACCESS_LOG.info("%(protocol)s %(model)s/%(version)s %(status)s rows=%(rows)d %(latency_ms).3fms", fields,
                    extra={"access": fields})


def request_id(given: str | bytes | None) -> str:
    """The id of a request: the client's, when it is a plain token of at most 64 characters, else a new one."""
    if isinstance(given, bytes):
        given = given.decode("latin-1")
    return given if given is not None and _CLIENT_ID.fullmatch(given) else f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"




@dataclass(frozen=True)
class Access:
    """The server's access rules: ``api_key`` (None: open) and ``cors_origins`` (``*`` admits any)."""

    api_key: str | None = None
    cors_origins: Sequence[str] = ()

    def __post_init__(self) -> None:
        """A key that no caller could present, or that every caller presents, is refused before the server
        starts: an empty key (say ``--api-key "$KEY"`` with KEY unset) would admit anyone."""
        key = self.api_key
        if key is None:
            return
        if not key.strip():
            raise OptionError("the API key is empty, which would admit every caller; give a key, or none for an "
                              "open server (an unset variable in --api-key \"$KEY\"?)")
        if not key.isascii() or not key.isprintable() or key != key.strip():
            raise OptionError("the API key must be printable ASCII without spaces at either end: HTTP headers "
                              "carry no other characters, so no caller could present it")

    def allows(self, credential: str | None) -> bool:
        """Whether a call presenting ``credential`` (its ``Authorization`` value, or an API key) may run."""
        if self.api_key is None:
            return True
        if credential is None:
            return False
        scheme, _, token = credential.partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else credential.strip()
        return hmac.compare_digest(presented.encode(), self.api_key.encode())

    def http_allows(self, path: str, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None or path.startswith(OPEN_HTTP_PREFIXES):
            return True
        credential = headers.get(b"authorization") or headers.get(b"x-api-key")
        return self.allows(None if credential is None else credential.decode("latin-1"))

    def cors_headers(self, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """The CORS headers of a response to a request from the ``Origin`` in ``headers`` (none when CORS is
        off or the origin is not admitted)."""
        origin = headers.get(b"origin")
        if origin is None or not self.cors_origins:
            return []
        if "*" not in self.cors_origins and origin.decode("latin-1") not in self.cors_origins:
            return []
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin"),
                (b"access-control-expose-headers", b"inference-header-content-length, x-request-id")]

    def preflight_headers(self, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """The answer to a browser's ``OPTIONS`` preflight: the methods, and the headers it asked to send."""
        allowed = self.cors_headers(headers)
        if not allowed:
            return []
        return [*allowed, (b"access-control-allow-methods", CORS_METHODS),
                (b"access-control-allow-headers", headers.get(b"access-control-request-headers", b"content-type")),
                (b"access-control-max-age", b"600")]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the API key (UNAUTHENTICATED), except health checks."""

    def __init__(self, access: Access) -> None:
        self.access = access

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.access.allows(metadata.get("authorization")):
            return handler
        return _refusing(handler)


def _refusing(handler: Any) -> Any:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    async def refuse(request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
