"""Run the HTTP and gRPC fronts for named servings until SIGINT or SIGTERM.

Start-up: every serving is served in process (warm-up compiles first, logged
with progress), then gRPC and HTTP bind (127.0.0.1 unless told otherwise) and
their URLs are logged. Shutdown on a signal: stop accepting, let in-flight
requests finish, drain every server's queue, exit; with a drain timeout, what
has not started by then is answered with ``ServerStoppedError`` instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import resource
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import uvicorn

from ..errors import OptionError
from ..serving.options import optional_seconds
from ..serving.registry import serve
from ..serving.server import Server
from ..serving.serving import Serving
from .access import Access
from .connection import GuardedHttpProtocol
from .grpc import GrpcServer
from .http import HttpFront
from .limits import Limits, Tls
from .repository import DEFAULT_LOAD_TIMEOUT, DEFAULT_LOADS_PER_MODEL, ModelRepository
from .service import InferenceService

log = logging.getLogger("jitserve.serve")

MAX_HTTP_WORKERS = 256
# open files kept beside the HTTP and gRPC connections: compilers, model files, logs, and refused connections
# lingering (LINGERING_REFUSALS)
FILES_KEPT_FREE = 256


class Attached(Protocol):
    """What :func:`run`'s ``attach`` starts beside the fronts: stopped at exit."""

    def stop(self) -> None: ...


class Shutdown:
    """Raises KeyboardInterrupt on the first SIGTERM that reaches it; later ones are logged and ignored, so
    that a second signal during the drain cannot break it off (SIGKILL stops at once)."""

    def __init__(self) -> None:
        self.signalled = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signalled:
            log.warning("%s while shutting down: ignored; the drain goes on (SIGKILL stops at once)",
                        signal.Signals(signum).name)
            return
        self.signalled = True
        raise KeyboardInterrupt(signal.Signals(signum).name)


class HttpServer(uvicorn.Server):
    """uvicorn's server, telling ``on_signal`` at the first signal, so that gRPC stops accepting and both
    fronts report not ready at the same moment HTTP stops accepting."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self._on_signal()
        elif sig == signal.SIGTERM:
            log.warning("SIGTERM while draining: ignored; the drain goes on (SIGKILL stops at once)")
        super().handle_exit(sig, frame)


def event_loop_factory(tls: bool = False) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it), else asyncio's. uvicorn picks
    it only when it runs the loop itself; jitserve runs uvicorn's server on a loop of its own making.
    With TLS, asyncio's: the connection guards start TLS on a paused connection (``loop.start_tls``), and
    uvloop 0.23 then hands some later connections' bytes to the protocol still encrypted."""
    if tls:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def start_locally(servings: Mapping[str, Serving]) -> Callable[[dict[str, Server]], None]:
    """A ``start`` for :func:`run`: every serving served in this process."""
    def start(servers: dict[str, Server]) -> None:
        for name, serving in servings.items():
            log.info("starting model '%s': %r", name, serving)
            servers[name] = serve(serving, name=name)

    return start


def start_repository(directory: str, mode: str, poll_seconds: float = 15.0,
                     load: tuple[str, ...] = (), load_timeout: float = DEFAULT_LOAD_TIMEOUT,
                     max_loads_per_model: int = DEFAULT_LOADS_PER_MODEL
                     ) -> Callable[[InferenceService], ModelRepository]:
    """A ``repository`` for :func:`run`: the models of ``directory`` under control ``mode`` (``load``: the
    models an ``explicit`` repository loads at start). The directory, mode and bounds are checked now."""
    settings = (mode, poll_seconds, load_timeout, max_loads_per_model)
    ModelRepository(directory, InferenceService({}), *settings)

    def start(service: InferenceService) -> ModelRepository:
        repository = ModelRepository(directory, service, *settings)
        service.control = repository
        repository.start(load)
        return repository

    return start


def check_http_workers(http_workers: int | None) -> None:
    """Refuse a count of HTTP front processes out of 1..MAX_HTTP_WORKERS (None: one process serves HTTP)."""
    if http_workers is not None and (isinstance(http_workers, bool) or not isinstance(http_workers, int)
                                     or not 1 <= http_workers <= MAX_HTTP_WORKERS):
        raise OptionError(f"--http-workers must be a count of front processes from 1 to {MAX_HTTP_WORKERS}, "
                          f"got {http_workers!r}")


def check_ports_free(host: str, ports: list[int | None]) -> None:
    """Refuse to start, before compiling anything, when another process listens on one of the ports (a
    second gRPC server would otherwise share the port and silently take a part of the first one's calls)."""
    for port in ports:
        if not port:
            continue
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise OptionError(f"port {port} on {host} is taken ({error.strerror}); stop what holds it, or "
                                  f"choose another with --port / --grpc-port") from None


def raise_file_limit() -> int:
    """Let the process hold as many connections as the system allows it: the soft limit on open files up to
    the hard one (often 1,024 against 1,048,576), so stalled connections do not exhaust it at 1,024. Returns
    the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("open files limit raised from %d to %d", soft, hard)
    return hard


def fit_connections(limits: Limits, open_files: int, grpc: bool = True) -> Limits:
    """``limits`` with at most as many HTTP (and gRPC) connections as leave ``FILES_KEPT_FREE`` of the
    ``open_files`` the process may hold: both caps lowered in proportion, so that a flood of connections to
    one front cannot take the descriptors the other, the models and the logs need."""
    room = max(open_files - FILES_KEPT_FREE, 2)
    wanted = limits.max_connections + (limits.max_grpc_connections if grpc else 0)
    if wanted <= room:
        return limits
    http = max(1, limits.max_connections * room // wanted)
    fitted = dataclasses.replace(limits, max_connections=http,
                                 max_grpc_connections=max(1, room - http) if grpc else limits.max_grpc_connections)
    log.warning("connection caps lowered to fit the %d files the process may open: --max-connections %d -> %d%s",
                open_files, limits.max_connections, fitted.max_connections,
                f", --max-grpc-connections {limits.max_grpc_connections} -> {fitted.max_grpc_connections}"
                if grpc else "")
    return fitted


def http_config(service: InferenceService, host: str, port: int, limits: Limits = Limits(), access: Access = Access(),
                tls: Tls | None = None, grace: float = 30.0, app: Any = None) -> uvicorn.Config:
    """uvicorn's configuration of jitserve's HTTP front (``app``, by default an ``HttpFront`` of ``service``):
    the connection guards of ``limits``, no access log, no lifespan or proxy headers; at shutdown requests
    in flight have ``grace`` seconds."""
    app = HttpFront(service, limits, access) if app is None else app
    return uvicorn.Config(app, host=host, port=port, lifespan="off",
                          proxy_headers=False, server_header=False, access_log=False, log_level="warning",
                          log_config=None,
                          # TLS is the protocol's, which counts a connection and times its handshake from accept
                          http=GuardedHttpProtocol.factory(limits, None if tls is None else tls.server_context()),
                          # seconds as a float work (uvicorn waits with asyncio); its annotation says int
                          timeout_graceful_shutdown=grace)  # type: ignore[arg-type]


async def _serve_fronts(count: int, service: InferenceService, host: str, port: int, limits: Limits, access: Access,
                        tls: Tls | None, grace: float, access_log: bool, opened: Callable[[], None],
                        stop_accepting: Callable[[], None]) -> None:
    """HTTP from ``count`` front processes over this one (``protocol/workers/``). They decode ``/infer``
    themselves unless what it may need lives in this process alone (client shared memory regions, traces):
    then every request is relayed here."""
    from .workers.engine import front_settings, serve_fronts

    local_infer = not service.shared_memory.allowed and service.tracing is None
    if not local_infer:
        log.info("HTTP: the front processes relay /infer to this one, which holds the shared memory regions "
                 "clients register and makes the traces")
    settings = front_settings(host, port, count, limits, access, tls, grace, access_log, local_infer)
    await serve_fronts(count, settings, service, HttpFront(service, limits, access), opened, stop_accepting, grace)


def run(start: Callable[[dict[str, Server]], None], host: str = "127.0.0.1", port: int = 8000,
        grpc_port: int | None = 8001, request_timeout: float | None = None, limits: Limits = Limits(),
        on_exit: Callable[[], None] | None = None, drain_timeout: float | None = None, access: Access = Access(),
        tls: Tls | None = None, attach: Callable[[InferenceService], Attached] | None = None,
        access_log: bool = False, trace_endpoint: str | None = None, allow_client_shm: bool = False,
        http_workers: int | None = None) -> None:
    """Serve over HTTP (and gRPC unless ``grpc_port`` is None) until a signal, holding clients to ``limits``
    and ``access`` (API key, CORS), over TLS when ``tls`` is given.
    ``start(servers)`` fills ``servers`` by model name (:func:`start_locally`, or a cluster's coalescers), and
    ``attach(service)`` starts what changes the models while they serve (:func:`start_repository`, a
    cluster front's ``FrontSync``), stopped at exit before the servers; at exit every server is stopped
    (drained, for at most ``drain_timeout`` seconds when given), then ``on_exit()`` runs. ``access_log``: one
    line per inference request (``protocol/access.py``); ``trace_endpoint``: OpenTelemetry spans sent to
    that OTLP/HTTP collector (``protocol/tracing.py``), flushed at exit; ``allow_client_shm``: clients may
    register system shared memory regions (``protocol/shared_memory.py``), all unregistered at exit;
    ``http_workers``: HTTP served by that many front processes over this one (``protocol/workers/``)."""
    check_http_workers(http_workers)
    optional_seconds("request_timeout", request_timeout)  # checked before anything starts: a NaN drain
    optional_seconds("drain_timeout", drain_timeout)  # timeout would otherwise fail only at exit
    check_ports_free(host, [port, grpc_port])
    limits = fit_connections(limits, raise_file_limit(), grpc=grpc_port is not None)
    grace = 30.0 if drain_timeout is None else drain_timeout  # seconds the drain may take at shutdown
    signal.signal(signal.SIGTERM, Shutdown())
    servers: dict[str, Server] = {}
    grpc_server = None
    service: InferenceService | None = None
    attached: Attached | None = None
    tracing = None
    if trace_endpoint is not None:
        from .tracing import Tracing  # OpenTelemetry is imported only when tracing is asked for

        tracing = Tracing.exporting_to(trace_endpoint)
    try:
        start(servers)
        service = InferenceService(servers, request_timeout, access_log, tracing, allow_client_shm)
        service.opening = http_workers is not None  # until every front listens (gRPC, started first, too)
        if attach is not None:
            attached = attach(service)
        if grpc_port is not None:
            grpc_server = GrpcServer(service, host, grpc_port, limits, access, tls)
            grpc_server.start()
            log.info("gRPC%s: %s:%d (inference.GRPCInferenceService)", " over TLS" if tls else "", host,
                     grpc_server.port)
        config = http_config(service, host, port, limits, access, tls, grace)

        def opened() -> None:
            service.opening = False
            if grpc_server is not None:
                grpc_server.opened()

        def stop_accepting() -> None:
            service.draining = True
            if grpc_server is not None:
                grpc_server.begin_stop(grace)

        # What exists now (jax, the compiled executables, the model) lives until the servers stop: out of the
        # collector's sight until then, a full collection no longer walks it in the middle of requests (p99 at 64
        # callers 100 -> 40 ms, bench/peers.py)
        gc.collect()
        gc.freeze()
        log.info("HTTP: %s://%s:%d/v2 (models: %s; OpenAI's API at /v1; metrics at /metrics)%s",
                 "https" if tls else "http", host, port,
                 ", ".join(service.models) or "none", "; API key required" if access.api_key is not None else "")
        with asyncio.Runner(loop_factory=event_loop_factory(tls is not None)) as runner:
            if http_workers is None:
                runner.run(HttpServer(config, stop_accepting).serve())
            else:
                runner.run(_serve_fronts(http_workers, service, host, port, limits, access, tls, grace, access_log,
                                         opened, stop_accepting))
    except KeyboardInterrupt as reason:
        log.info("%s: shutting down", str(reason) or "SIGINT")
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace)
        if attached is not None:
            attached.stop()
        for name, server in (servers if service is None else service.servers()).items():
            server.stop(timeout=drain_timeout)
            log.info("model '%s' drained and stopped: %s", name, server.stats())
        if service is not None:
            service.shared_memory.close()
        if on_exit is not None:
            on_exit()
        if tracing is not None:
            tracing.shutdown()
        # back in the collector's sight, the stopped servers' cycles (a partition thread's target is its server)
        # are freed before the interpreter exits; frozen, IREE's runtime objects in them outlived it and
        # nanobind reported every one as leaked at exit
        gc.unfreeze()
