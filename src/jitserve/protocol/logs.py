"""The server's log: one format for jitserve's and uvicorn's lines, text or JSON, each with its request id.

A request's id is the client's ``X-Request-ID`` (HTTP header or gRPC metadata)
when it sends one, else a fresh one; the fronts set it for the time the request
is handled, every line logged meanwhile carries it, and HTTP responses echo it.
``--log-format json`` writes one JSON object per line (``time``, ISO 8601 in UTC, ``level``,
``logger``, ``message``, ``request_id`` when there is one, ``error`` with the
traceback), as log collectors read them.
"""

from __future__ import annotations

import contextvars
import datetime
import itertools
import logging
import os
import re

import orjson

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("jitserve_request_id", default=None)
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_tag)s"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_ID_PREFIX = os.urandom(4).hex()  # this process's: ids of several servers do not collide
_ID_COUNTER = itertools.count(1)  # then a counter: no system call per request, as uuid4 makes


def request_id(given: str | bytes | None) -> str:
    """The id of a request: the client's, when it is a plain token of at most 64 characters, else a new one."""
    if isinstance(given, bytes):
        given = given.decode("latin-1")
    return given if given is not None and _CLIENT_ID.fullmatch(given) else f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


class _RequestTag(logging.Filter):
    """Puts the current request id on every record (``request_id``, and `` [request ID]`` for text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = REQUEST_ID.get()
        record.request_id = current
        record.request_tag = f" [request {current}]" if current else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                                       timespec="milliseconds"), "level": record.levelname, "logger": record.name,
                                   "message": record.getMessage()}
        if getattr(record, "request_id", None):
            line["request_id"] = record.request_id  # type: ignore[attr-defined]
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """The root logger writes ``log_format`` lines to stderr; uvicorn's loggers go through it too."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestTag())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
