"""Servers by name in this process: ``serve``, ``batched_run`` and ``batched_run_async``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ..errors import ServerExistsError, UnknownServerError
from .server import Server
from .serving import Serving

_servers: dict[str, Server] = {}
_lock = threading.Lock()


def serve(serving: Serving, name: str | None = None) -> Server:
    """Start a server for ``serving`` registered as ``name`` (default: the function's name).

    With ``input_template`` set, every batch size is compiled on every
    partition before the server accepts requests. Use it as a context manager,
    or call ``stop()``.
    """
    name = name or getattr(serving.fn, "__name__", None) or "serving"
    server = Server(serving, name)
    with _lock:
        if name in _servers:
            raise ServerExistsError(f"a server named {name!r} is already running; stop it or pick another name")
        _servers[name] = server
    try:
        return server.start()
    except BaseException:
        unregister(name, server)
        raise


def unregister(name: str, server: Server) -> None:
    with _lock:
        if _servers.get(name) is server:
            del _servers[name]


def lookup(name: str) -> Server:
    server = _servers.get(name)
    if server is None:
        running = ", ".join(sorted(_servers)) or "none"
        raise UnknownServerError(f"no server named {name!r} is running here (running: {running})")
    return server


def servers() -> dict[str, Server]:
    """The running servers by name."""
    return dict(_servers)


def batched_run(name: str, value: Any, timeout: float | None = None) -> Any:
    """Run ``value`` (a Batch, or what the serving's ``preprocess`` takes) on server ``name``, batched
    with concurrent callers; returns exactly this caller's rows."""
    server = lookup(name)
    return server.result(server.submit(server.serving.to_batch(value)), timeout)


async def batched_run_async(name: str, value: Any, timeout: float | None = None) -> Any:
    """``batched_run`` for asyncio callers: awaits the rows without blocking the event loop."""
    server = lookup(name)
    request = server.submit(server.serving.to_batch(value), asyncio.get_running_loop())
    return await server.result_async(request, timeout)
