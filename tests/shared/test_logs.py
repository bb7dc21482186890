"""Log lines a pipeline can parse (one JSON object each, with the request and trace they concern), and lines a
person reads where stderr is a terminal."""

import io
import json
import logging
import os
import re
import select
import subprocess
import sys
import time

import pytest

from shared import logs
from tests.processes import REPO, free_port

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


TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) *\S+: .*")


def test_text_format_reads_time_level_logger_message_then_the_ids(stderr, monkeypatch):
    monkeypatch.setenv("KVSERVE_LOG_FORMAT", "text")
    logs.configure("kvserve-test")
    logging.getLogger("kvserve.x").warning("slow", extra={"request_id": "r4", "trace_id": TRACE})
    logging.getLogger("kvserve.x").info("plain")
    first, second = stderr.getvalue().splitlines()
    assert TEXT_LINE.fullmatch(first) and TEXT_LINE.fullmatch(second)
    assert first.endswith(f" WARNING kvserve.x: slow request_id=r4 trace_id={TRACE}")
    assert second.endswith(" INFO    kvserve.x: plain")
    with pytest.raises(ValueError, match="xml"):
        logs.configure("kvserve-test", "xml")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_text_on_a_terminal_and_json_elsewhere_and_a_format_asked_for_wins(monkeypatch):
    monkeypatch.delenv("KVSERVE_LOG_FORMAT", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert [logs.resolve(None), logs.resolve("auto"), logs.resolve("json")] == ["text", "text", "json"]
    monkeypatch.setenv("KVSERVE_LOG_FORMAT", "json")
    assert logs.resolve(None) == "json" and logs.resolve("text") == "text"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("KVSERVE_LOG_FORMAT")
    assert [logs.resolve(None), logs.resolve("auto"), logs.resolve("text")] == ["json", "json", "text"]


def gateway_log(default_model: str, redis_url: str, terminal: bool) -> list[str]:
    """The whole lines `kvserve gateway` (no --log-format, no KVSERVE_LOG_FORMAT) writes until it serves, its
    stdout and stderr a pseudo-terminal or a pipe."""
    argv = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "gateway",
        "--model",
        default_model,
        "--redis-url",
        redis_url,
    ]
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_LOG_FORMAT"}
    reader, writer = os.openpty() if terminal else os.pipe()
    process = subprocess.Popen(
        [*argv, "--port", str(free_port())],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=writer,
        stderr=writer,
    )
    os.close(writer)
    output = b""
    deadline = time.monotonic() + 60
    try:
        while b"Uvicorn running" not in output and time.monotonic() < deadline:
            if select.select([reader], [], [], 1)[0]:
                try:
                    chunk = os.read(reader, 65536)
                except OSError:  # EIO: the terminal's other side has closed
                    break
                if not chunk:
                    break
                output += chunk
    finally:
        process.kill()  # its threads only: nothing of its own is left
        process.wait()
        os.close(reader)
    text = output.decode(errors="replace").replace("\r\n", "\n")  # a terminal writes \r\n
    assert "Uvicorn running" in text, text
    return text[: text.rindex("\n")].splitlines()


def test_a_command_on_a_terminal_logs_text_and_on_a_pipe_json(default_model, redis_url):
    on_terminal = gateway_log(default_model, redis_url, terminal=True)
    assert on_terminal and all(TEXT_LINE.fullmatch(line) for line in on_terminal), on_terminal
    assert any(" INFO    uvicorn.error: Application startup complete." in line for line in on_terminal)
    on_pipe = [json.loads(line) for line in gateway_log(default_model, redis_url, terminal=False)]
    startup = {"logger": "uvicorn.error", "message": "Application startup complete."}
    assert any(startup.items() <= line.items() for line in on_pipe), on_pipe


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
