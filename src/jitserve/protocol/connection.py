"""Per-connection guards for the HTTP front: uvicorn's httptools protocol with the limits it lacks.

uvicorn bounds neither the time a client takes to send its request, nor the
size of its headers, nor the number of open connections, nor the time a
response may wait for a client that stopped reading; a few hundred stalled
sockets would hold every file descriptor and a few unread responses the
memory. This protocol enforces the :class:`~.limits.Limits`:

- a connection beyond ``max_connections`` is answered 503 and closed at once
  (over TLS: closed before its handshake); connections are counted from
  accept, TLS handshakes included, and a handshake must finish within
  ``read_timeout`` (asyncio's default is 60 s): TLS is set up here, with
  ``loop.start_tls``, rather than by the listening socket, where a stalled
  handshake is neither counted nor cut;
- a refused connection lingers up to ``LINGER_SECONDS`` so that its client
  reads the answer; at most ``LINGERING_REFUSALS`` at a time, each new one
  cutting the oldest short, so that a burst cannot spend the spare
  descriptors;
- the request line and headers must arrive within ``read_timeout`` seconds,
  and the body may pause at most that long between reads: else 408 and closed
  (nothing of the request runs);
- request line and headers larger than ``max_header_bytes``: 431 and closed;
- at shutdown, idle connections are dropped at once (not after a TLS close);
- a response whose client stops reading for ``write_timeout`` seconds is
  dropped and the connection aborted (the transport's buffer is freed).

And one thing uvicorn does per response that costs: it writes a response's
status line and headers, then its body, each at once, two sends (and two TCP
segments) for every small answer. Writes within one turn of the event loop
go out as one (:class:`OneSend`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import ssl
from collections.abc import Callable
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .disconnect import CLIENT_LEAVING
from .limits import Limits
from .logs import ClientMistakes

log = logging.getLogger("jitserve.http")

LINGER_SECONDS = 1.0
LINGERING_REFUSALS = 64  # descriptors refused connections may hold while their clients read the answer
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


class _RefusalError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OneSend:
    """A connection's transport whose writes within one turn of the event loop leave as one write: the first
    is held until the turn ends (``call_soon``), the ones after it join it. A response's head and body, which
    uvicorn writes one after the other, become one send on the socket; a stream's events still leave as each
    comes. Closing or ending the stream sends what is held first; aborting drops it with the rest of the
    buffer. Everything else is the transport's own."""

    __slots__ = ("transport", "held", "loop")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.held: list[bytes] = []
        self.loop = loop

    def write(self, data: bytes) -> None:
        held = self.held
        if not held:
            self.loop.call_soon(self.flush)
        held.append(data)

    def flush(self) -> None:
        held = self.held
        if held:
            data = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self.held.clear()
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + sum([len(data) for data in self.held])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


@dataclasses.dataclass
class Spent:
    """What one HTTP server's connections hold beyond uvicorn's count of open ones: TLS handshakes under way,
    and refused connections lingering; and how their refusals are logged (a flood of them, once a kind of
    refusal is no longer new, as debug lines)."""

    handshaking: int = 0
    lingering: collections.deque[asyncio.Transport] = dataclasses.field(default_factory=collections.deque)
    refusals: ClientMistakes = dataclasses.field(default_factory=lambda: ClientMistakes(log))  # their log lines


class GuardedHttpProtocol(HttpToolsProtocol):
    """One HTTP connection, under the server's limits; TLS, when ``tls`` is given, set up once counted."""

    def __init__(self, *args: Any, limits: Limits, spent: Spent, tls: ssl.SSLContext | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.spent = spent
        self.tls = tls
        self._before_open: list[bytes] | None = None  # TLS: what arrived before the handshake's end was seen
        self._lost = False
        self._reading_headers = True
        self._header_bytes = 0
        self._read_deadline: float | None = None  # loop time the request being read is overdue; None: none is
        self._on_read_timeout: Callable[[], None] = self._headers_overdue
        self._read_timer: asyncio.TimerHandle | None = None  # fires at a deadline, maybe an older one
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._leaving: list[Callable[[], None]] = []  # called if the connection is lost (its requests' clients gone)
        self._extensions: dict[str, dict[object, object]] = {CLIENT_LEAVING: {"callbacks": self._leaving}}  # ASGI's

    @classmethod
    def factory(cls, limits: Limits, tls: ssl.SSLContext | None = None) -> Any:
        """What uvicorn's ``Config(http=...)`` takes: this class with the limits, a count of what one server's
        connections spend and the TLS context (uvicorn's own ``ssl`` stays unset) bound."""
        return functools.partial(cls, limits=limits, spent=Spent(), tls=tls)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        if len(self.connections) + self.spent.handshaking >= self.limits.max_connections:
            message = f"the server holds its limit of {self.limits.max_connections} open connections; retry later"
            if self.tls is None:
                self._refuse(503, message)
            else:
                self.spent.refusals.tell(f"client {self._peer()}: TLS connection closed before its handshake: "
                                         f"{message}")
                transport.abort()
            return
        if self.tls is None:
            self._open(transport)
            return
        transport.pause_reading()  # nothing reaches the HTTP parser before the handshake takes over
        self._before_open = []
        self.spent.handshaking += 1
        self.loop.create_task(self._handshake(transport, self.tls))

    def _open(self, transport: asyncio.Transport) -> None:
        super().connection_made(cast(asyncio.Transport, OneSend(transport, self.loop)))
        self._arm_read(self._headers_overdue)

    async def _handshake(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        """TLS on the accepted connection, within ``read_timeout``; a connection that fails or stalls it is
        closed (logged at debug: scanners and health checks do it all day)."""
        try:
            secure = await self.loop.start_tls(transport, self, tls, server_side=True,
                                               ssl_handshake_timeout=self.limits.read_timeout)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as error:
            log.debug("client %s: TLS handshake failed: %s", self._peer(), error or type(error).__name__)
            transport.abort()
            return
        except BaseException:
            transport.abort()
            raise
        finally:
            self.spent.handshaking -= 1
        received, self._before_open = self._before_open or [], None
        if secure is None or self._lost:  # the client went away as the handshake ended
            transport.abort()
            return
        self._open(secure)
        for data in received:  # the request may come with the handshake's end, before start_tls returns
            self.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._before_open is not None:  # a TLS connection that never opened
            self._lost = True
            return
        if self._refused:  # its client read the answer and closed: no need to linger
            with contextlib.suppress(ValueError):
                self.spent.lingering.remove(self.transport)
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        for left in tuple(self._leaving):
            left()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._before_open is not None:
            self._before_open.append(data)
            return
        if self._refused:  # answered and closing: what the client still sends is read and dropped
            return
        self._unset_keepalive_if_required()
        if self._reading_headers:
            self._header_bytes += len(data)
            if self._read_deadline is None:
                self._arm_read(self._headers_overdue)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, _RefusalError):
                self._refuse(error.__context__.status, str(error.__context__))
                return
            self._invalid()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            self._invalid()
            return
        if self._reading_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, self._headers_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        given = self.scope.get("extensions")  # none from uvicorn today; any it adds are kept
        self.scope["extensions"] = self._extensions if given is None else {**given, **self._extensions}
        self._arm_read(self._headers_overdue)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            raise _RefusalError(431, self._headers_too_large())
        self._reading_headers = False
        self._arm_read(self._body_stalled)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm_read(self._body_stalled)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_read()
        self._reading_headers, self._header_bytes = True, 0
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._not_reading)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def shutdown(self) -> None:
        """At server shutdown: an idle connection whose output is flushed is dropped at once (closing it
        would wait up to 30 s for a TLS peer's close_notify); one with a request in flight closes after it."""
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            super().shutdown()

    def _headers_too_large(self) -> str:
        return (f"the request line and headers exceed the limit of {self.limits.max_header_bytes} bytes "
                f"(--max-header-bytes)")

    def _arm_read(self, on_timeout: Callable[[], None]) -> None:
        """``on_timeout()`` unless the client sends the next part within ``read_timeout`` seconds. Re-arming
        (at each request and body chunk) only moves the deadline: the one timer of the connection looks at
        it when it fires, and waits on if it moved, instead of a timer made and cancelled each time."""
        self._read_deadline = self.loop.time() + self.limits.read_timeout
        self._on_read_timeout = on_timeout
        if self._read_timer is None:
            self._read_timer = self.loop.call_at(self._read_deadline, self._read_timer_fired)

    def _cancel_read(self) -> None:
        self._read_deadline = None

    def _read_timer_fired(self) -> None:
        self._read_timer = None
        deadline = self._read_deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:
            self._read_timer = self.loop.call_at(deadline, self._read_timer_fired)
            return
        self._read_deadline = None
        self._on_read_timeout()

    def _headers_overdue(self) -> None:
        if self.cycle is None or self.cycle.response_complete:  # nothing of a request is running
            self._refuse(408, f"the request line and headers did not arrive within {self.limits.read_timeout:g} s "
                              f"(--read-timeout)")

    def _body_stalled(self) -> None:
        if self.cycle is not None and not self.cycle.response_started:
            self.cycle.disconnected = True  # the application's receive() ends: nothing of it runs
            self.cycle.message_event.set()
            self._refuse(408, f"the request body paused for more than {self.limits.read_timeout:g} s "
                              f"(--read-timeout); nothing ran")

    def _not_reading(self) -> None:
        log.warning("client %s stopped reading its response for %g s (--write-timeout): connection aborted",
                    self._peer(), self.limits.write_timeout)
        self.transport.abort()

    def _invalid(self) -> None:
        self._refuse(400, "invalid HTTP request")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with a JSON error and close the connection, lingering a moment: closing a socket
        with unread input resets it, and the client would lose the answer."""
        self.spent.refusals.tell(f"client {self._peer()}: {status} {message}")
        self._refused = True
        self._cancel_read()
        if self.transport.is_closing():
            return
        body = json.dumps({"error": message}).encode()
        retry = b"retry-after: 1\r\n" if status == 503 else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n%s\r\n%s" % (status, REASONS[status], len(body), retry, body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        lingering = self.spent.lingering
        if len(lingering) >= LINGERING_REFUSALS:  # the one that has lingered longest has had its time
            lingering.popleft().abort()
        lingering.append(self.transport)
        self.loop.call_later(LINGER_SECONDS, self._linger_over, self.transport)

    def _linger_over(self, transport: asyncio.Transport) -> None:
        with contextlib.suppress(ValueError):  # already cut short by newer refusals
            self.spent.lingering.remove(transport)
            transport.abort()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
