"""The server's log: one format for jitserve's and uvicorn's lines, text or JSON, each with its request id.

Every line logged while a request is handled carries its id (``access.REQUEST_ID``).
``--log-format json`` writes one JSON object per line (``time``, ISO 8601 in UTC, ``level``,
``logger``, ``message``, ``request_id`` when there is one, ``error`` with the
traceback), as log collectors read them.
"""

from __future__ import annotations

import datetime
import logging

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
