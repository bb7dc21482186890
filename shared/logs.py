"""Log lines as one JSON object each, or as text for a person, carrying the request id and trace id they concern.

The format is `auto` unless asked for: text when stderr is a terminal (`make run`), JSON otherwise (a file, a
pipe, a container's log), so a pipeline never has to parse text and a person never reads JSON. A request's ids
come from `bind` (for everything logged in that task or context) or from a call's
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

FORMATS = ("auto", "json", "text")  # --log-format's choices; auto: text on a terminal
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
    """`2026-01-31 12:00:00.123 WARNING kvserve.x: message request_id=r4 trace_id=...`, in local time; an
    exception follows on the next lines."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s%(ids)s", "%Y-%m-%d %H:%M:%S"
        )

    def format(self, record: logging.LogRecord) -> str:
        record.ids = "".join(f" {name}={value}" for name, value in _ids(record).items())
        return super().format(record)


def resolve(fmt: str | None) -> str:
    """json or text: the format asked for, else KVSERVE_LOG_FORMAT, else auto, which is text when stderr is a
    terminal. `kvserve up` hands its children the result, so they log as it does."""
    fmt = (fmt or os.environ.get("KVSERVE_LOG_FORMAT") or "auto").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "auto":
        return "text" if _is_terminal(sys.stderr) else "json"
    return fmt


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def configure(service: str, fmt: str | None = None, level: int = logging.INFO) -> None:
    """One stderr handler on the root logger in the format asked (resolve()); calling it again replaces the
    handler it installed before."""
    fmt = resolve(fmt)
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
