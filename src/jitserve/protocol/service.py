"""What the HTTP and gRPC fronts share: the models, inference, and errors as statuses.

Every network request goes through the model's server (``submit`` and
``result_async``), so HTTP and gRPC callers share batches with each other and
with in-process callers.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import __version__
from ..errors import (
    BatchError,
    BodyTooLargeError,
    BatchSizeError,
    ProtocolError,
    QueueFullError,
    ServerStoppedError,
    TemplateMismatchError,
    UnknownServerError,
)
from ..serving.server import Server
from .codec import ModelSpec, select_outputs
from .metrics import Metrics

log = logging.getLogger("jitserve.serve")

EXTENSIONS = ["binary_tensor_data"]

# exception class -> (HTTP status, gRPC status name); the first match in order wins
STATUSES: tuple[tuple[type[BaseException], int, str], ...] = (
    (UnknownServerError, 404, "NOT_FOUND"),
    (BodyTooLargeError, 413, "RESOURCE_EXHAUSTED"),
    (ProtocolError, 400, "INVALID_ARGUMENT"),
    (BatchError, 400, "INVALID_ARGUMENT"),
    (BatchSizeError, 400, "INVALID_ARGUMENT"),
    (TemplateMismatchError, 400, "INVALID_ARGUMENT"),
    (QueueFullError, 503, "UNAVAILABLE"),
    (ServerStoppedError, 503, "UNAVAILABLE"),
    (TimeoutError, 504, "DEADLINE_EXCEEDED"),
)


def status_of(error: BaseException) -> tuple[int, str]:
    """The HTTP and gRPC status for an error; anything unexpected is 500 / INTERNAL."""
    for kind, http, grpc in STATUSES:
        if isinstance(error, kind):
            return http, grpc
    return 500, "INTERNAL"


class InferenceService:
    """The served models by name, and inference on them."""

    def __init__(self, servers: Mapping[str, Server], request_timeout: float | None = None) -> None:
        self.models = {name: ModelSpec(name, server) for name, server in servers.items()}
        self.request_timeout = request_timeout
        self.metrics = Metrics(servers)
        self.draining = False  # set on SIGTERM: not ready, while what was accepted finishes

    def model(self, name: str) -> ModelSpec:
        spec = self.models.get(name)
        if spec is None:
            raise UnknownServerError(f"unknown model '{name}'; this server has: {', '.join(self.models) or 'none'}")
        return spec

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "jitserve", "version": __version__, "extensions": EXTENSIONS}

    def ready(self) -> bool:
        return not self.draining and all(not spec.server.stopping for spec in self.models.values())

    async def infer(self, model: str, tensors: Mapping[str, np.ndarray], requested: Sequence[str] | None,
                    priority: int | None = None) -> list[tuple[str, np.ndarray]]:
        """Run one request's tensors on ``model`` at ``priority`` (the request's ``priority`` parameter, as
        tritonclient sends it); the named outputs it asked for."""
        spec = self.model(model)
        batch = spec.to_batch(tensors)
        server = spec.server
        serving = server.serving
        if serving.streaming:
            raise ProtocolError(f"model '{model}' streams its results: call it with ModelStreamInfer (gRPC) or "
                                f"POST /v2/models/{model}/infer_stream (HTTP, server-sent events)")
        request = server.submit(batch, asyncio.get_running_loop(), priority)
        outputs = serving.finish(await server.result_async(request, self._timeout(serving, priority)))
        return select_outputs(spec.named_outputs(outputs), requested, model)

    def infer_stream(self, model: str, tensors: Mapping[str, np.ndarray], requested: Sequence[str] | None,
                     priority: int | None = None) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        """``infer`` whose outputs come as they are ready: one item per batch that ran some of the rows (in
        row order), or per step of a streaming serving. The request is checked and queued now (its errors
        raise here, before anything is sent); a consumer that stops early frees its queued rows."""
        spec = self.model(model)
        batch = spec.to_batch(tensors)
        server = spec.server
        request = server.submit(batch, asyncio.get_running_loop(), priority, stream=True)
        return self._stream(spec, request, requested, self._timeout(server.serving, priority))

    @staticmethod
    async def _stream(spec: ModelSpec, request: Any, requested: Sequence[str] | None,
                      timeout: float | None) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        server = spec.server
        async for outputs in server.stream_async(request, timeout):
            yield select_outputs(spec.named_outputs(server.serving.finish(outputs)), requested, spec.name)

    def _timeout(self, serving: Any, priority: int | None) -> float | None:
        return self.request_timeout if self.request_timeout is not None else serving.default_timeout(priority)

    def count(self, model: str, protocol: str, status: int | str) -> None:
        self.metrics.requests.labels(model if model in self.models else "", protocol, str(status)).inc()

    def failed(self, protocol: str, model: str, error: BaseException) -> tuple[int, str, str]:
        """Count and log a failed request; returns its HTTP status, gRPC status name and the message for the
        client. A model's own failure (500 / INTERNAL) is logged with its traceback under a request id and
        the client gets only that id; a client's mistake is one warning line. What the client sent is
        escaped and cut before it reaches the log."""
        http_status, grpc_status = status_of(error)
        status: int | str = http_status if protocol == "http" else grpc_status
        if http_status == 500:
            request_id = uuid.uuid4().hex[:12]
            log.error("%s: model '%s' failed (request id %s)", protocol, loggable(model), request_id, exc_info=error)
            message = f"internal error in model '{model}'; the server log has the details under request id {request_id}"
        else:
            log.warning("%s: model '%s': %s: %s", protocol, loggable(model), status, loggable(str(error)))
            message = str(error)
        self.count(model, protocol, status)
        return http_status, grpc_status, message


LOGGED_CHARACTERS = 300


def loggable(text: str) -> str:
    """Client-controlled text as it may enter a log line: control characters escaped (no forged lines),
    at most ``LOGGED_CHARACTERS`` characters."""
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped if len(escaped) <= LOGGED_CHARACTERS else escaped[:LOGGED_CHARACTERS] + "..."
