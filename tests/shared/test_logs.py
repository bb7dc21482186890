"""Log lines a pipeline can parse: one JSON object each, with the request and trace they concern."""

import io
import json
import logging
import re
import sys

import pytest

from shared import logs

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def stderr(monkeypatch):
    """What the handler configure() installs writes; the root logger as it was afterwards."""
    out = io.StringIO()
    monkeypatch.delenv("KVSERVE_LOG_FORMAT", raising=False)
    real_configure = logs.configure

    def configure(*args):
        monkeypatch.setattr(sys, "stderr", out)  # here, not at setup: pytest swaps sys.stderr per phase
        real_configure(*args)

    monkeypatch.setattr(logs, "configure", configure)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield out
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_carry_time_level_logger_message_and_service(stderr):
    logs.configure("kvserve-test")
    logging.getLogger("kvserve.x").info("hello %s", "world")
    logging.getLogger("kvserve.x").debug("not at INFO")
    (line,) = lines(stderr)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line.pop("time"))
    assert line == {
        "level": "INFO",
        "logger": "kvserve.x",
        "message": "hello world",
        "service": "kvserve-test",
    }


def test_ids_come_from_bind_and_extra_wins(stderr):
    logs.configure("kvserve-test", "json")
    log = logging.getLogger("kvserve.x")
    token = logs.bind(request_id="r1")
    inner = logs.bind(trace_id=TRACE)  # adds to what is bound
    log.info("both bound")
    log.info("own ids", extra={"request_id": "r2", "trace_id": None})
    logs.unbind(inner)
    log.info("request only")
    logs.unbind(token)
    log.info("none")
    got = [{k: line.get(k) for k in ("message", "request_id", "trace_id")} for line in lines(stderr)]
    assert got == [
        {"message": "both bound", "request_id": "r1", "trace_id": TRACE},
        {
            "message": "own ids",
            "request_id": "r2",
            "trace_id": TRACE,
        },  # an empty extra falls back to the bound
        {"message": "request only", "request_id": "r1", "trace_id": None},
        {"message": "none", "request_id": None, "trace_id": None},
    ]


def test_an_exception_goes_with_its_line(stderr):
    logs.configure("kvserve-test")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("kvserve.x").exception("step failed", extra={"request_id": "r3"})
    (line,) = lines(stderr)
    assert line["level"] == "ERROR" and line["message"] == "step failed" and line["request_id"] == "r3"
    assert line["exception"].startswith("Traceback") and line["exception"].endswith("ValueError: boom")


def test_text_format_shows_the_ids(stderr, monkeypatch):
    monkeypatch.setenv("KVSERVE_LOG_FORMAT", "text")
    logs.configure("kvserve-test")
    logging.getLogger("kvserve.x").warning("slow", extra={"request_id": "r4", "trace_id": TRACE})
    logging.getLogger("kvserve.x").warning("plain")
    first, second = stderr.getvalue().splitlines()
    assert first.endswith(f" WARNING kvserve.x request_id=r4 trace_id={TRACE}: slow")
    assert second.endswith(" WARNING kvserve.x: plain")
    with pytest.raises(ValueError, match="xml"):
        logs.configure("kvserve-test", "xml")


def test_configure_again_replaces_its_handler_and_takes_in_uvicorn(stderr):
    uvicorn = logging.getLogger("uvicorn.error")
    uvicorn.addHandler(logging.StreamHandler(io.StringIO()))  # as uvicorn's own dictConfig would leave it
    uvicorn.propagate = False
    logs.configure("kvserve-test", "text")
    logs.configure("kvserve-test", "json")
    uvicorn.info("Application startup complete.")
    logging.getLogger("uvicorn").info("from uvicorn")
    assert [line["message"] for line in lines(stderr)] == ["Application startup complete.", "from uvicorn"]
    assert not uvicorn.handlers and uvicorn.propagate
