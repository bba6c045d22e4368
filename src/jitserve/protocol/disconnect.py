"""A client that leaves before its answer: waiting for its disconnect (ASGI's ``http.disconnect``, once the
request's body has been read), and cancelling what would answer it, so that a generation nobody will read
frees its slots at its next step instead of running to its last token (an SDK that timed out sends it again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
# the answer to a client that left first (nginx's "client closed request"): never sent, uvicorn drops it
CLIENT_GONE: tuple[int, list[tuple[bytes, bytes]], bytes] = (499, [], b"")


async def disconnected(receive: Callable[..., Any]) -> None:
    """Return once the client has gone (its request's body already read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(receive: Callable[..., Any], answer: Awaitable[_T]) -> _T | None:
    """``answer``'s result, or None if the client disconnects first (``answer`` cancelled)."""
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
