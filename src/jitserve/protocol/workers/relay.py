"""Requests a front process does not decode itself, relayed to the engine's own HTTP application as ASGI
messages: the request's scope and body there, the response's start and body back, the client's disconnect
there. So every such route answers as one process answers it (health, metadata, statistics, ``/metrics``,
the model repository's load and unload, streams, Triton's generate extension, OpenAI's API), from the
engine that holds the models and counts their requests.

:func:`relay` is the front's side, :func:`answer_relayed` the engine's; a :class:`Link` is either's end of
the socket between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from .ring import (
    ENGINE_GONE,
    NO_SLOT,
    RELAY,
    RELAY_ABORT,
    RELAY_BODY,
    RELAY_CHUNK,
    RELAY_END,
    RELAY_GONE,
    RELAY_HEAD,
    RELAY_LAST,
    Outbox,
)

_TEXT_FIELDS = ("method", "path", "scheme", "http_version", "root_path")
_BYTES_FIELDS = ("raw_path", "query_string")
GONE = {"type": "http.disconnect"}


class Link(Protocol):
    """One end of the socket between a front and the engine: its frames out, and the relayed requests in
    flight by tag (each with what the other side sent for it, in order)."""

    outbox: Outbox
    relays: dict[int, asyncio.Queue[Any]]


def _headers_out(headers: Any) -> list[list[str]]:
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


def _headers_in(headers: list[list[str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]


def pack_scope(scope: dict[str, Any]) -> bytes:
    """An HTTP request's ASGI scope as JSON (bytes as latin-1 text)."""
    fields: dict[str, Any] = {name: scope.get(name) for name in _TEXT_FIELDS}
    fields.update({name: (scope.get(name) or b"").decode("latin-1") for name in _BYTES_FIELDS})
    fields.update(headers=_headers_out(scope["headers"]), client=scope.get("client"), server=scope.get("server"))
    return orjson.dumps(fields)


def unpack_scope(payload: bytes) -> dict[str, Any]:
    fields = orjson.loads(payload)
    fields.update({name: fields[name].encode("latin-1") for name in _BYTES_FIELDS})
    fields.update(type="http", asgi={"version": "3.0", "spec_version": "2.3"}, headers=_headers_in(fields["headers"]),
                  client=fields["client"] and tuple(fields["client"]),
                  server=fields["server"] and tuple(fields["server"]))
    return fields


async def relay(link: Link, tag: int, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                send: Callable[[Any], Awaitable[None]]) -> None:
    """The front's side: the request goes to the engine as it is read, the response comes back as the engine
    sends it. A client that disconnects is told to the engine (a stream stops, its rows are freed); an
    engine that goes away first is a 503 when nothing of the answer was sent yet."""
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    link.relays[tag] = inbox
    link.outbox.send(RELAY, tag, NO_SLOT, pack_scope(scope))
    pump = asyncio.ensure_future(_pump(link.outbox, tag, receive))
    started = False
    try:
        while True:
            item = await inbox.get()
            if item is None:  # the engine is gone
                if not started:
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
                    await send({"type": "http.response.body", "body": orjson.dumps({"error": ENGINE_GONE})})
                return
            kind, payload = item
            if kind == RELAY_HEAD:
                status, headers = orjson.loads(payload)
                await send({"type": "http.response.start", "status": status, "headers": _headers_in(headers)})
                started = True
            elif kind == RELAY_ABORT:  # the engine's application ended without a whole answer
                return
            else:
                await send({"type": "http.response.body", "body": payload, "more_body": kind == RELAY_CHUNK})
                if kind == RELAY_END:
                    return
    finally:
        pump.cancel()
        if link.relays.pop(tag, None) is not None:
            link.outbox.send(RELAY_GONE, tag)


async def _pump(outbox: Outbox, tag: int, receive: Callable[[], Awaitable[Any]]) -> None:
    """The request's body to the engine as it is read, then the client's disconnect."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            outbox.send(RELAY_GONE, tag)
            return
        outbox.send(RELAY_BODY if message.get("more_body") else RELAY_LAST, tag, NO_SLOT, message.get("body", b""))


def relayed_message(kind: int, payload: bytes) -> dict[str, Any]:
    """What the engine's application receives for a front's frame of a relayed request."""
    if kind == RELAY_GONE:
        return GONE
    return {"type": "http.request", "body": payload, "more_body": kind == RELAY_BODY}


async def answer_relayed(app: Callable[..., Awaitable[None]], link: Link, writable: Callable[[], Awaitable[None]],
                         tag: int, scope: dict[str, Any]) -> None:
    """The engine's side: ``app`` (the engine's HTTP application) answers the relayed request; its messages go
    back to the front as frames, each waiting (``writable``) while the socket to the front is full. Once the
    front says the client is gone, what the application sends goes nowhere."""
    inbox = link.relays[tag]
    finished = False

    async def send(message: dict[str, Any]) -> None:
        nonlocal finished
        if tag not in link.relays:
            return
        if message["type"] == "http.response.start":
            head = orjson.dumps([message["status"], _headers_out(message.get("headers", ()))])
            link.outbox.send(RELAY_HEAD, tag, NO_SLOT, head)
        else:
            finished = not message.get("more_body", False)
            link.outbox.send(RELAY_END if finished else RELAY_CHUNK, tag, NO_SLOT, bytes(message.get("body", b"")))
        await writable()

    try:
        await app(scope, inbox.get, send)
    finally:
        if link.relays.pop(tag, None) is not None and not finished:
            link.outbox.send(RELAY_ABORT, tag)
