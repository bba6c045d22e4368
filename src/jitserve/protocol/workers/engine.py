"""The engine's side of ``jitserve serve --http-workers N``: the front processes, started, restarted when
one dies and drained at shutdown, and the engine's end of each one's socket and ring.

A front's ``/infer`` requests run on the engine's :class:`~jitserve.protocol.service.InferenceService`
(as they would in one process: the model by name, its checks, the corridor, the batch), so the batches form
across every front; the answers, or the errors as the service words (and counts) them, go back through the
ring. The front tells the engine each answer it sent, and each request it refused itself (a malformed
body), a count per set of labels once per turn of its event loop (``COUNT``), so that the engine's
``/metrics`` and statistics hold every front's requests. Its other requests run on the engine's own HTTP
application (``relay.py``). A front that dies takes only its own requests with it: the engine cancels them
(their queued rows are withdrawn) and starts the front again. On SIGTERM the fronts stop accepting and
finish what they hold, served by the engine until the last has exited; then the engine drains its servers
as one process does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ...errors import FrontProcessError
from ..access import REQUEST_ID, REQUEST_ROWS, Access
from ..limits import Limits, Tls
from ..logs import JsonFormatter
from ..service import InferenceService
from .relay import answer_relayed, relayed_message, unpack_scope
from .ring import (
    ANSWER,
    CANCEL,
    CONFIG,
    COUNT,
    DONE,
    FAILED,
    GO,
    INFER,
    LISTENING,
    NO_SLOT,
    READY,
    RELAY,
    RELAY_BODY,
    RELAY_GONE,
    RELAY_LAST,
    Message,
    Peer,
    Ring,
    read_message,
)

log = logging.getLogger("jitserve.serve")

FRONT_MODULE = "jitserve.protocol.workers.front"
EXIT_MARGIN = 10.0  # seconds a front may take past the drain's grace to exit before it is killed
RESTART_PAUSE = 1.0  # seconds between tries to start again a front that exits before it listens


class FrontLink(Peer):
    """The engine's end of one front process: its socket and ring, its requests in flight by tag."""

    def __init__(self, index: int, process: subprocess.Popen[bytes], ring: Ring, service: InferenceService,
                 app: Callable[..., Awaitable[None]], on_lost: Callable[[FrontLink], None]) -> None:
        super().__init__(asyncio.get_running_loop())
        self.index, self.process, self.ring, self.service, self.app = index, process, ring, service, app
        self.on_lost = on_lost
        self.tasks: dict[int, asyncio.Task[None]] = {}  # its requests running here, by tag
        self.relays: dict[int, asyncio.Queue[Any]] = {}  # its relayed requests' messages, by tag
        self.ready: asyncio.Future[None] = self.loop.create_future()  # it has bound the port
        self.listening: asyncio.Future[None] = self.loop.create_future()  # it listens: connections reach it
        self.closed: asyncio.Future[None] = self.loop.create_future()  # its socket closed: it exited
        self._writable = asyncio.Event()
        self._writable.set()
        self.handlers = {INFER: self._infer, CANCEL: self._cancel, COUNT: self._count, READY: self._ready,
                         LISTENING: self._listening,
                         RELAY: self._relay, RELAY_BODY: self._relayed, RELAY_LAST: self._relayed,
                         RELAY_GONE: self._relayed}

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self.tasks.values():
            task.cancel()  # its callers are gone: their queued rows are withdrawn
        for inbox in self.relays.values():
            inbox.put_nowait(relayed_message(RELAY_GONE, b""))
        self.relays.clear()
        self._writable.set()
        for started in (self.ready, self.listening):
            if not started.done():
                started.set_exception(FrontProcessError(
                    f"HTTP front process {self.index} (pid {self.process.pid}) exited before it listened; the "
                    f"lines it logged above say why"))
                started.exception()  # retrieved here: the starter may be gone
        self.ring.close()  # its front is gone; the link may live on in a cycle (its handlers) until a collection
        self.closed.set_result(None)
        self.on_lost(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def writable(self) -> None:
        """Return once the socket to the front takes more (a relayed answer waits here for a slow client)."""
        if not self._writable.is_set():
            await self._writable.wait()

    def _ready(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        self.ready.set_result(None)

    def _listening(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        self.listening.set_result(None)

    def _infer(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        header, tensors = read_message(payload or self.ring.slot(slot))
        task = self.loop.create_task(self._answer(tag, slot, header, tensors))
        self.tasks[tag] = task

    async def _answer(self, tag: int, slot: int, header: dict[str, Any], tensors: list[Any]) -> None:
        """One front's request through the service, as one process runs it; its answer, or its error as the
        service words it (logged here, where the traceback is), back into its slot."""
        REQUEST_ID.set(header["r"])
        model, version = header["m"], header["v"]
        try:
            served, outputs = await self.service.infer(model, dict(tensors), header["c"], header["p"], version,
                                                       header["a"])
            self._reply(ANSWER, tag, slot, Message({"v": served, "n": REQUEST_ROWS.get()}, outputs))
        except asyncio.CancelledError:
            self.outbox.send(DONE, tag, slot)
        except Exception as error:  # noqa: BLE001 - the front answers it, with the status the service gives
            status, grpc_status, message = self.service.refusal("http", model, error)
            counted = self.service.counted(model, "http", status, version)  # the front adds no count to it
            self._reply(FAILED, tag, slot, Message({"s": status, "g": grpc_status, "e": message, "v": counted,
                                                    "n": REQUEST_ROWS.get()}))
        finally:
            self.tasks.pop(tag, None)

    def _reply(self, kind: int, tag: int, slot: int, message: Message) -> None:
        if slot != NO_SLOT and message.size <= self.ring.slot_bytes:
            message.write(self.ring.slot(slot))
            self.outbox.send(kind, tag, slot)
        else:
            self.outbox.send(kind, tag, slot, message.inline())

    def _cancel(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        task = self.tasks.get(tag)
        if task is not None:
            task.cancel()

    def _count(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        for model, protocol, status, version, times in orjson.loads(payload):
            self.service.counted(model, protocol, status, version, times)

    def _relay(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        self.relays[tag] = asyncio.Queue()
        task = self.loop.create_task(answer_relayed(self.app, self, self.writable, tag, unpack_scope(payload)))
        self.tasks[tag] = task
        task.add_done_callback(lambda _: self.tasks.pop(tag, None))

    def _relayed(self, kind: int, tag: int, slot: int, payload: bytes) -> None:
        inbox = self.relays.get(tag)
        if inbox is None:
            return
        inbox.put_nowait(relayed_message(kind, payload))
        if kind == RELAY_GONE:
            del self.relays[tag]  # what the application sends from now on goes nowhere


def front_settings(host: str, port: int, count: int, limits: Limits, access: Access, tls: Tls | None,
                   grace: float, access_log: bool, local_infer: bool) -> dict[str, Any]:
    """What each front process is told at start (over its socket: the API key stays off command lines). The
    connection cap is shared out: each front holds its part of ``max_connections``."""
    root = logging.getLogger()
    share = max(1, math.ceil(limits.max_connections / count))
    return {"host": host, "port": port, "limits": {**vars(limits), "max_connections": share},
            "api_key": access.api_key, "cors_origins": list(access.cors_origins),
            "tls": None if tls is None else [tls.cert, tls.key], "grace": grace, "access_log": access_log,
            "log_json": any(isinstance(handler.formatter, JsonFormatter) for handler in root.handlers),
            "log_level": root.level, "local_infer": local_infer}


class Fronts:
    """The front processes: started (each in a session of its own: the engine alone tells them to stop),
    started again when one exits, drained at shutdown."""

    def __init__(self, count: int, settings: dict[str, Any], service: InferenceService,
                 app: Callable[..., Awaitable[None]]) -> None:
        self.settings, self.service, self.app = settings, service, app
        self.links: list[FrontLink | None] = [None] * count
        self.stopping = False
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start every front; once all have bound the port, let them listen, and return once all listen (the
        kernel spreads new connections over the sockets listening when they come: a server reported ready
        while some fronts were still on their way would give its first clients to the others alone)."""
        links = await asyncio.gather(*(self._start(index) for index in range(len(self.links))))
        for link in links:
            link.outbox.send(GO)
        await asyncio.gather(*(link.listening for link in links))

    async def _start(self, index: int) -> FrontLink:
        loop = asyncio.get_running_loop()
        ring = Ring.create()
        ours, theirs = socket.socketpair()
        process = subprocess.Popen([sys.executable, "-m", FRONT_MODULE, str(theirs.fileno()), str(ring.fd)],
                                   pass_fds=(theirs.fileno(), ring.fd), start_new_session=True)
        theirs.close()
        ring.close_file()
        _, link = await loop.connect_accepted_socket(
            lambda: FrontLink(index, process, ring, self.service, self.app, self._lost), ours)
        self.links[index] = link
        link.outbox.send(CONFIG, payload=orjson.dumps({**self.settings, "index": index}))
        await link.ready
        return link

    def _lost(self, link: FrontLink) -> None:
        if not self.stopping and link.ready.done() and link.ready.exception() is None:
            restart = asyncio.ensure_future(self._restart(link))
            self._restarts.add(restart)
            restart.add_done_callback(self._restarts.discard)

    async def _restart(self, link: FrontLink) -> None:
        code = await asyncio.to_thread(_reap, link.process)
        log.warning("HTTP front process %d (pid %d) %s: the requests it held are lost; starting it again",
                    link.index, link.process.pid, _how_it_ended(code))
        while not self.stopping:
            try:
                started = await self._start(link.index)
            except FrontProcessError as error:
                log.error("%s; trying again in %g s", error, RESTART_PAUSE)
                await asyncio.sleep(RESTART_PAUSE)
                continue
            started.outbox.send(GO)
            try:
                await started.listening
            except FrontProcessError as error:
                log.error("%s; trying again in %g s", error, RESTART_PAUSE)
                await asyncio.sleep(RESTART_PAUSE)
                continue
            log.info("HTTP front process %d started again (pid %d)", link.index, started.process.pid)
            return

    async def drain(self, grace: float) -> None:
        """Tell every front to stop accepting and finish its requests (SIGTERM), and wait until all have
        exited, for at most ``grace`` seconds and a margin (then they are killed)."""
        self.stopping = True
        links = [link for link in self.links if link is not None]
        for link in links:
            if link.process.poll() is None:
                link.process.send_signal(signal.SIGTERM)
        _, late = await asyncio.wait([link.closed for link in links], timeout=grace + EXIT_MARGIN)
        if late:
            log.warning("%d HTTP front processes did not finish within %g s of SIGTERM: killed", len(late),
                        grace + EXIT_MARGIN)
            self.kill()
        await asyncio.to_thread(lambda: [_reap(link.process) for link in links])

    def kill(self) -> None:
        self.stopping = True
        for link in self.links:
            if link is not None and link.process.poll() is None:
                link.process.kill()

    def pids(self) -> list[int]:
        return [link.process.pid for link in self.links if link is not None]


def _reap(process: subprocess.Popen[bytes]) -> int:
    """The exit status of a front whose socket closed (killed if it lingers past ``EXIT_MARGIN``)."""
    try:
        return process.wait(timeout=EXIT_MARGIN)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


async def serve_fronts(count: int, settings: dict[str, Any], service: InferenceService,
                       app: Callable[..., Awaitable[None]], opened: Callable[[], None],
                       stop_accepting: Callable[[], None], grace: float) -> None:
    """Run ``count`` front processes (``opened()`` once all listen: ready) until SIGINT or SIGTERM, then drain
    them (``stop_accepting`` first: not ready, gRPC refusing). The signal is raised again once they have
    exited, for the caller's own shutdown, as uvicorn's server does; a second one meanwhile is logged and
    ignored."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    captured: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if captured:
            log.warning("%s while the HTTP fronts drain: ignored (SIGKILL stops at once)",
                        signal.Signals(signum).name)
            return
        captured.append(signum)
        loop.call_soon_threadsafe(stop.set)

    originals = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    fronts = Fronts(count, settings, service, app)
    try:
        await fronts.start()
        opened()  # ready: a client sent on now may reach any front (the kernel spreads them)
        log.info("HTTP: %d front processes share the port (pids %s)", count, ", ".join(map(str, fronts.pids())))
        await stop.wait()
        log.info("%s: the HTTP front processes stop accepting and finish their requests",
                 signal.Signals(captured[0]).name)
        stop_accepting()
        await fronts.drain(grace)
    finally:
        fronts.kill()
        for original, handler in originals.items():
            signal.signal(original, handler)
    for caught in captured:
        signal.raise_signal(caught)
