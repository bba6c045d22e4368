"""Per-connection guards for the HTTP front: uvicorn's httptools protocol with the limits it lacks.

uvicorn bounds neither the time a client takes to send its request, nor the
size of its headers, nor the number of open connections, nor the time a
response may wait for a client that stopped reading; a few hundred stalled
sockets would hold every file descriptor and a few unread responses the
memory. This protocol enforces the :class:`~.limits.Limits`:

- a connection beyond ``max_connections`` is answered 503 and closed at once;
- the request line and headers must arrive within ``read_timeout`` seconds,
  and the body may pause at most that long between reads: else 408 and closed
  (nothing of the request runs);
- request line and headers larger than ``max_header_bytes``: 431 and closed;
- at shutdown, idle connections are dropped at once (not after a TLS close);
- a response whose client stops reading for ``write_timeout`` seconds is
  dropped and the connection aborted (the transport's buffer is freed).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .limits import Limits

log = logging.getLogger("jitserve.http")

LINGER_SECONDS = 1.0
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


class _RefusalError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class GuardedHttpProtocol(HttpToolsProtocol):
    """One HTTP connection, under the server's limits."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._reading_headers = True
        self._header_bytes = 0
        self._read_deadline: float | None = None  # loop time the request being read is overdue; None: none is
        self._on_read_timeout: Callable[[], None] = self._headers_overdue
        self._read_timer: asyncio.TimerHandle | None = None  # fires at a deadline, maybe an older one
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False

    @classmethod
    def factory(cls, limits: Limits) -> Any:
        """What uvicorn's ``Config(http=...)`` takes: this class with the limits bound."""
        return functools.partial(cls, limits=limits)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._refuse(503, f"the server holds its limit of {self.limits.max_connections} open connections; "
                              f"retry later")
            return
        super().connection_made(transport)
        self._arm_read(self._headers_overdue)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
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
        log.warning("client %s: %d %s", self._peer(), status, message)
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
        self.loop.call_later(LINGER_SECONDS, self.transport.abort)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
