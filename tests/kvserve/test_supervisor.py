"""The supervisor of `kvserve up`'s children, on real child processes: reaped, logged, restarted with backoff,
given up on when they keep dying, left dead while shutting down."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve import supervisor as supervisor_module
from kvserve.supervisor import FIRST_BACKOFF_S, RESTART_LIMIT, RESTART_WINDOW_S, Supervisor, stop_processes
from tests.processes import eventually


class Starts:
    """A child's start function that remembers every process it started (and when), to stop them all."""

    def __init__(self, *argv: str) -> None:
        self.argv = list(argv)
        self.processes: list[subprocess.Popen] = []
        self.times: list[float] = []

    def __call__(self) -> subprocess.Popen:
        self.processes.append(subprocess.Popen(self.argv))
        self.times.append(time.monotonic())
        return self.processes[-1]

    def stop(self) -> None:
        stop_processes(self.processes, 5)


def reaped(pid: int) -> bool:
    """Gone from the process table: not running and not a zombie either."""
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture
def supervisor():
    supervisor = Supervisor()
    yield supervisor
    supervisor.halt()


def test_killed_child_is_reaped_logged_and_restarted_after_a_backoff(supervisor, caplog):
    caplog.set_level(logging.INFO, "kvserve.up")
    starts = Starts("sleep", "60")
    deaths: list[str] = []
    supervisor.on_death = deaths.append
    try:
        first = supervisor.start("sleeper", starts)
        supervisor.watch(on_failure=pytest.fail)
        os.kill(first.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert eventually(lambda: len(starts.processes) == 2, timeout=5)
        assert starts.times[1] - killed_at >= FIRST_BACKOFF_S - 0.05
        assert reaped(first.pid)
        assert supervisor.process("sleeper") is starts.processes[1] and starts.processes[1].poll() is None
        assert deaths == ["sleeper"]
        assert f"sleeper died (pid {first.pid}, killed by SIGKILL)" in caplog.text
        assert f"sleeper restarted (pid {starts.processes[1].pid})" in caplog.text
        assert supervisor.failure is None
    finally:
        starts.stop()


def test_child_that_keeps_dying_is_given_up_on_with_its_name(supervisor, caplog, monkeypatch):
    first_backoff = 0.1  # the rule at a fifth of its pace: 0.1 + 0.2 + 0.4 + 0.8 s of backoff, not 7.5 s
    monkeypatch.setattr(supervisor_module, "FIRST_BACKOFF_S", first_backoff)
    starts = Starts("sh", "-c", "exit 3")
    failures: list[str] = []
    try:
        supervisor.start("crasher", starts)
        supervisor.watch(on_failure=failures.append)
        assert eventually(lambda: failures, timeout=15), caplog.text
        assert len(starts.processes) == RESTART_LIMIT
        gaps = [b - a for a, b in zip(starts.times, starts.times[1:], strict=False)]
        assert all(gap >= first_backoff * 2**i - 0.05 for i, gap in enumerate(gaps)), gaps
        assert failures == [supervisor.failure]
        assert f"crasher died {RESTART_LIMIT} times within {RESTART_WINDOW_S:.0f} s" in failures[0]
        assert "exit code 3" in failures[0]
        time.sleep(1)
        assert len(starts.processes) == RESTART_LIMIT  # given up on: never started again
        assert all(reaped(p.pid) for p in starts.processes)
    finally:
        starts.stop()


def test_child_that_exits_while_shutting_down_is_reaped_not_restarted(supervisor, caplog):
    caplog.set_level(logging.INFO, "kvserve.up")
    starts = Starts("sleep", "60")
    try:
        first = supervisor.start("sleeper", starts)
        supervisor.watch(on_failure=pytest.fail)
        supervisor.hold()
        first.terminate()
        assert eventually(lambda: reaped(first.pid), timeout=5)
        time.sleep(FIRST_BACKOFF_S + 0.5)
        assert len(starts.processes) == 1
        assert "sleeper exited during shutdown" in caplog.text
    finally:
        starts.stop()


def test_stop_processes_kills_a_process_that_ignores_sigterm():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        started = time.monotonic()
        stop_processes([stubborn], timeout_s=0.5)
        assert stubborn.returncode == -signal.SIGKILL
        assert time.monotonic() - started < 5
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
