"""A client that leaves before its answer: knowing that it has gone, and cancelling what would answer it, so
that a generation nobody will read frees its slots at its next step instead of running to its last token (an
SDK that timed out sends it again), and a request's queued rows leave the queue.

jitserve's own HTTP server (``protocol/connection.py``) tells its application when a connection is lost:
the scope's extension ``CLIENT_LEAVING`` holds that connection's list of ``callbacks``, called then. That
costs a request about a microsecond, so every request that waits on an answer is watched. Under another
ASGI server (and for a request relayed from an HTTP front process), a task waits for ASGI's
``http.disconnect`` (once the request's body has been read) where a ``receive`` is given: two tasks per
request (about 16 us), which only long requests (streams, a generation's) are worth.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
# the answer to a client that left first (nginx's "client closed request"): never sent, uvicorn drops it
CLIENT_GONE: tuple[int, list[tuple[bytes, bytes]], bytes] = (499, [], b"")
CLIENT_LEAVING = "jitserve.client_leaving"  # the scope's extension: callbacks to call if the connection is lost
# the request's connection's callbacks (this request's task only), None under another ASGI server
LEAVING: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar("leaving", default=None)


def begin_watch(scope: dict[str, Any]) -> None:
    """Make the callbacks of the connection ``scope`` came on this request's (its task's)."""
    leaving = (scope.get("extensions") or {}).get(CLIENT_LEAVING)
    LEAVING.set(None if leaving is None else leaving["callbacks"])


async def disconnected(receive: Callable[..., Any]) -> None:
    """Return once the client has gone (its request's body already read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(answer: Awaitable[_T], receive: Callable[..., Any] | None = None) -> _T | None:
    """``answer``'s result, or None if the client disconnects first (``answer`` cancelled); under another
    ASGI server, watched only where ``receive`` is given."""
    leaving = LEAVING.get()
    if leaving is not None:
        return await _unless_left(leaving, answer)
    if receive is None:
        return await answer
    answering = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(disconnected(receive))
    gone = False
    try:
        await asyncio.wait({answering, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = not answering.done()
    finally:
        watcher.cancel()
        if not answering.done():
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)
    return None if gone else answering.result()


async def _unless_left(leaving: list[Callable[[], None]], answer: Awaitable[_T]) -> _T | None:
    """``answer`` awaited by this task, which the connection's loss cancels (the cancellation taken back)."""
    task = asyncio.current_task()
    assert task is not None, "a request is answered in a task"
    gone = False

    def left() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    leaving.append(left)
    try:
        answered = await answer
    except asyncio.CancelledError:
        if not gone:
            raise
    finally:
        leaving.remove(left)
    if gone:  # cancelled for it, or the cancellation swallowed inside and the answer came: nobody reads it
        task.uncancel()
        return None
    return answered
