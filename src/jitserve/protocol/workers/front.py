"""One HTTP front process of ``jitserve serve --http-workers N`` (``python -m jitserve.protocol.workers.front
SOCKET_FD RING_FD``, started by the engine, told its settings over the socket).

It serves the HTTP port beside the other fronts (``SO_REUSEPORT``: the kernel spreads the connections) with
jitserve's own HTTP front, ``protocol/http.py``'s ``HttpFront``, under the same connection guards, over a
:class:`RingService`: a request to ``/infer`` is read, decoded and answered here, its tensors handed to the
engine through this front's ring of shared memory slots; every other request is relayed to the engine
(``relay.py``). On SIGTERM (from the engine) it stops accepting, finishes what it holds and exits; when the
engine is gone, it answers what it holds 503 and exits.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from ...errors import RelayedError, ServerStoppedError
from ..access import REQUEST_ID, REQUEST_ROWS, Access, log_access
from ..app import HttpServer, event_loop_factory, fit_connections, http_config, raise_file_limit
from ..http import HttpFront
from ..limits import Limits, Tls
from ..logs import configure
from ..service import InferenceService, loggable
from .relay import relay
from .ring import (
    ANSWER,
    CANCEL,
    COUNT,
    DONE,
    ENGINE_GONE,
    FAILED,
    GO,
    HEAD,
    INFER,
    LISTENING,
    NO_SLOT,
    READY,
    RELAY_ABORT,
    RELAY_CHUNK,
    RELAY_END,
    RELAY_HEAD,
    Message,
    Peer,
    Ring,
    read_message,
)


class EngineLink(Peer):
    """A front's end of its socket and ring: requests in flight by tag, each with the slot it holds (freed
    when the engine answers, or says it cancelled it)."""

    def __init__(self, ring: Ring, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.ring = ring
        self.free = list(range(ring.slots))  # a stack: the slots used last, warm in the cache, are used first
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.relays: dict[int, asyncio.Queue[Any]] = {}
        self.go: asyncio.Future[None] = loop.create_future()  # the engine says: listen
        self.lost: asyncio.Future[None] = loop.create_future()  # the engine is gone
        self._tag = 0
        self._counts: dict[tuple[str, str, int | str, str | None], int] = {}
        self.handlers = {GO: self._go, ANSWER: self._answer, FAILED: self._answer, DONE: self._done,
                         RELAY_HEAD: self._relayed, RELAY_CHUNK: self._relayed, RELAY_END: self._relayed,
                         RELAY_ABORT: self._relayed}

    def connection_lost(self, exc: Exception | None) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ServerStoppedError(ENGINE_GONE))
        self.pending.clear()
        for inbox in self.relays.values():
            inbox.put_nowait(None)
        self.lost.set_result(None)

    def count(self, labels: tuple[str, str, int | str, str | None], times: int) -> None:
        """Count answers for the engine's ``jitserve_requests_total``: sent once per turn of the event loop, a
        count per set of labels."""
        if not self._counts:
            self.loop.call_soon(self._send_counts)
        self._counts[labels] = self._counts.get(labels, 0) + times

    def _send_counts(self) -> None:
        counts, self._counts = self._counts, {}
        self.outbox.send(COUNT, payload=orjson.dumps([[*labels, times] for labels, times in counts.items()]))

    def tag(self) -> int:
        self._tag = (self._tag + 1) & 0xFFFFFFFF
        return self._tag

    async def infer(self, header: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], Any]:
        """One request to the engine: the answer's header and outputs (or the engine's error raised)."""
        if self.lost.done():
            raise ServerStoppedError(ENGINE_GONE)
        message = Message(header, tensors.items())
        tag = self.tag()
        future = self.loop.create_future()
        if self.free and message.size <= self.ring.slot_bytes:
            slot = self.free.pop()
            message.write(self.ring.slot(slot))
            self.outbox.send(INFER, tag, slot)
        else:
            slot = NO_SLOT
            self.outbox.send(INFER, tag, slot, message.inline())
        self.pending[tag] = future
        try:
            return await future
        except asyncio.CancelledError:
            if tag in self.pending:  # the engine cancels it too; its slot comes back with the engine's word
                self.outbox.send(CANCEL, tag)
            raise

    def _answer(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        future = self.pending.pop(tag, None)
        if future is not None and not future.done():
            header, outputs = read_message(payload or self.ring.slot(slot))
            if kind == ANSWER:
                future.set_result((header, outputs))
            else:
                future.set_exception(RelayedError(header["e"], header["s"], header["g"], header["v"], header["n"]))
        if slot != NO_SLOT:
            self.free.append(slot)

    def _done(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        self.pending.pop(tag, None)
        if slot != NO_SLOT:
            self.free.append(slot)

    def _go(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        self.go.set_result(None)

    def _relayed(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        inbox = self.relays.get(tag)
        if inbox is not None:
            inbox.put_nowait((kind, payload))


class RingService(InferenceService):
    """The service ``HttpFront`` calls in a front process: inference goes to the engine's service through the
    ring, and each answer is counted there (``COUNT``), so that ``/metrics`` and the statistics, which the
    engine answers, hold every front's requests. An error the engine answered with is logged and counted
    there and keeps its status and words here; the front's own (a malformed body) are worded and logged
    here."""

    def __init__(self, link: EngineLink, access_log: bool) -> None:
        super().__init__({}, access_log=access_log)
        self.link = link

    async def infer(self, model: str, tensors: Mapping[str, np.ndarray], requested: Mapping[str, int] | None,
                    priority: int | None = None, version: str | None = None,
                    parameters: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[str, np.ndarray]]]:
        header, outputs = await self.link.infer({"m": model, "v": version, "c": requested, "p": priority,
                                                 "a": parameters, "r": REQUEST_ID.get()}, tensors)
        REQUEST_ROWS.set(header["n"])
        return header["v"], outputs

    def counted(self, model: str, protocol: str, status: int | str, version: str | None = None,
                times: int = 1) -> str:
        self.link.count((model, protocol, status, version), times)
        return version or ""

    def failed(self, protocol: str, model: str, error: BaseException,
               version: str | None = None) -> tuple[int, str, str]:
        if isinstance(error, RelayedError):  # logged and counted by the engine
            if self.access_log:
                REQUEST_ROWS.set(error.rows)
                log_access(loggable(model), error.version, protocol, error.status)
            return error.status, error.grpc_status, str(error)
        return super().failed(protocol, model, error, version)


class FrontApp:
    """A front's ASGI application: ``POST .../infer`` through ``HttpFront`` here (``local``), every other
    request relayed to the engine's."""

    def __init__(self, http: HttpFront, link: EngineLink, local: bool) -> None:
        self.http, self.link, self.local = http, link, local

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if self.local and scope["method"] == "POST" and scope["path"].endswith("/infer"):
            await self.http(scope, receive, send)
        else:
            await relay(self.link, self.link.tag(), scope, receive, send)


def _read_settings(connection: socket.socket) -> dict[str, Any]:
    """The engine's first frame: this front's settings."""
    head = connection.recv(HEAD.size, socket.MSG_WAITALL)
    if len(head) < HEAD.size:
        sys.exit(1)  # the engine is gone already
    length = HEAD.unpack(head)[3]
    settings: dict[str, Any] = orjson.loads(connection.recv(length, socket.MSG_WAITALL))
    return settings


def _listener(host: str, port: int) -> socket.socket:
    """The HTTP port, bound beside the other fronts' (not listening yet: the engine says when)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(address)
    return listener


async def _serve(connection: socket.socket, ring: Ring, listener: socket.socket, settings: dict[str, Any],
                 limits: Limits, tls: Tls | None) -> None:
    loop = asyncio.get_running_loop()
    _, link = await loop.connect_accepted_socket(lambda: EngineLink(ring, loop), connection)
    service = RingService(link, settings["access_log"])
    access = Access(settings["api_key"], tuple(settings["cors_origins"]))
    app = FrontApp(HttpFront(service, limits, access), link, settings["local_infer"])
    config = http_config(service, settings["host"], settings["port"], limits, access, tls, settings["grace"], app)
    server = HttpServer(config, lambda: setattr(service, "draining", True))
    stopped: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not stopped.done():
            stopped.set_result(None)

    def stop(signum: int, frame: Any) -> None:
        """SIGTERM before the server runs (or raised again by it once it drained): no exception (one raised
        here could land in a garbage collector's callback and be lost), only flags it reads."""
        service.draining = server.should_exit = True
        loop.call_soon_threadsafe(settle)

    signal.signal(signal.SIGTERM, stop)  # while it serves, uvicorn's own handler takes SIGTERM
    link.outbox.send(READY)
    await asyncio.wait([link.go, link.lost, stopped], return_when=asyncio.FIRST_COMPLETED)
    if link.lost.done() or stopped.done():
        return
    link.lost.add_done_callback(lambda _: setattr(server, "should_exit", True))
    gc.collect()
    gc.freeze()  # as the engine does: what lives until exit is out of the collector's sight
    listener.listen(config.backlog)  # before the engine reports ready (uvicorn listening again changes nothing)
    link.outbox.send(LISTENING)
    await server.serve(sockets=[listener])  # a SIGTERM that came meanwhile set should_exit: it drains at once


def main(argv: Sequence[str] | None = None) -> int:
    socket_fd, ring_fd = (int(arg) for arg in (argv or sys.argv[1:]))
    connection = socket.socket(fileno=socket_fd)
    ring = Ring(ring_fd)
    ring.close_file()
    settings = _read_settings(connection)
    configure("json" if settings["log_json"] else "text", settings["log_level"])
    limits = fit_connections(Limits(**settings["limits"]), raise_file_limit(), grpc=False)
    tls = None if settings["tls"] is None else Tls(*settings["tls"])
    try:
        listener = _listener(settings["host"], settings["port"])
    except OSError as error:
        print(f"HTTP front process {settings['index']}: cannot bind {settings['host']}:{settings['port']}: "
              f"{error.strerror}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=event_loop_factory(tls is not None)) as runner:
        runner.run(_serve(connection, ring, listener, settings, limits, tls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
