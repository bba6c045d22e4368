"""The server's log: one format for jitserve's and uvicorn's lines, text or JSON, each with its request id;
and how the answers to clients' mistakes reach it without flooding it.

Every line logged while a request is handled carries its id (``access.REQUEST_ID``).
``--log-format json`` writes one JSON object per line (``time``, ISO 8601 in UTC, ``level``,
``logger``, ``message``, ``request_id`` when there is one, ``error`` with the
traceback), as log collectors read them.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading

import orjson

from .access import REQUEST_ID

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_tag)s"


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
        line.update(getattr(record, "access", ()))  # an access log line's fields
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


class ClientMistakes:
    """The log lines of the answers to clients' mistakes (a 4xx, a refusal), so that a client that repeats
    one in a loop cannot flood the log: the first ``FIRST`` of each kind are a WARNING line each; then the
    10th, 100th, 1,000th... of that kind is one, saying how many there were; the others are DEBUG lines.
    A kind is a line with its quoted names and its numbers taken out (``unknown model '...'`` whatever the
    name); at most ``KINDS`` kinds are told apart, the others counted as one. Every answer is still counted
    in ``/metrics`` (``jitserve_requests_total`` by status) and listed by ``--access-log``."""

    FIRST = 3
    KINDS = 256
    NAMES_AND_NUMBERS = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()  # the HTTP front's event loop and the gRPC front's thread both tell

    def tell(self, line: str) -> None:
        kind = self.NAMES_AND_NUMBERS.sub("", line[:500])
        with self._lock:
            if kind not in self._seen and len(self._seen) >= self.KINDS:
                kind = ""
            seen = self._seen[kind] = self._seen.get(kind, 0) + 1
        if seen <= self.FIRST:
            self.log.warning("%s", line)
        elif re.fullmatch(r"10+", str(seen)):
            self.log.warning("%s (%d answers of this kind so far; after the first %d, each is a DEBUG line but "
                             "the 10th, 100th, 1,000th...)", line, seen, self.FIRST)
        else:
            self.log.debug("%s", line)
