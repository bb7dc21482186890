"""Log lines as one JSON object each (or plain text), carrying the request id and trace id they concern.

A request's ids come from `bind` (for everything logged in that task or context) or from a call's
`extra={"request_id": ..., "trace_id": ...}`, which wins. One stderr handler on the root logger serves every
logger, uvicorn's included, so a log pipeline sees one format per process.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

FORMATS = ("json", "text")
_FIELDS = ("request_id", "trace_id")
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")

_bound: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "kvserve_log_ids", default=None
)


def bind(request_id: str | None = None, trace_id: str | None = None) -> contextvars.Token:
    """Attach ids to every line logged from this context on, until `unbind` with the returned token."""
    given = {"request_id": request_id, "trace_id": trace_id}
    return _bound.set({**(_bound.get() or {}), **{k: v for k, v in given.items() if v is not None}})


def unbind(token: contextvars.Token) -> None:
    _bound.reset(token)


def _ids(record: logging.LogRecord) -> dict[str, str]:
    """The record's request and trace ids: from its extra, else from the bound context."""
    bound = _bound.get() or {}
    ids = {}
    for name in _FIELDS:
        value = getattr(record, name, None) or bound.get(name)
        if value:
            ids[name] = str(value)
    return ids


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        """ISO 8601 in UTC with milliseconds, e.g. 2026-01-31T12:00:00.123Z."""
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
            **_ids(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(ids)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.ids = "".join(f" {name}={value}" for name, value in _ids(record).items())
        return super().format(record)


def configure(service: str, fmt: str | None = None, level: int = logging.INFO) -> None:
    """One stderr handler on the root logger in the format asked (else KVSERVE_LOG_FORMAT, else json);
    calling it again replaces the handler it installed before."""
    fmt = (fmt or os.environ.get("KVSERVE_LOG_FORMAT") or "json").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format: {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    handler._kvserve = True  # marks the handler a later configure() replaces
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_kvserve", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # uvicorn.run(..., log_config=None) leaves its loggers as they are: make sure they reach our handler,
    # and only it, even if something configured them before
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.disabled = False  # a dictConfig before (uvicorn's own, in a test process) may have disabled it
        logger.setLevel(logging.NOTSET)
