"""Keeps `kvserve up`'s child processes alive: a child that dies is reaped, logged and started again after a
backoff; one that keeps dying is given up on, and `kvserve up` with it.

The rule: the first restart waits FIRST_BACKOFF_S, each further death within RESTART_WINDOW_S doubles the wait,
and the RESTART_LIMIT-th death within RESTART_WINDOW_S is final (0.5, 1, 2, 4 s, then the fifth death within a
minute ends it). A thread of its own polls the children, beside uvicorn in the main thread. It lives as long as
the process: the children it restarts die with the thread that started them (shared/parent_death.py).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvserve.up")

RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.5
POLL_S = 0.1  # how soon a death is noticed


def describe_exit(returncode: int) -> str:
    """Popen's returncode as a person says it: negative is the signal that killed it."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(slots=True)
class Child:
    name: str
    start: Callable[[], subprocess.Popen]  # starts it (again) and returns the new process
    process: subprocess.Popen
    deaths: list[float] = field(default_factory=list)  # time.monotonic() of each within the window
    restart_at: float | None = None  # while it waits out its backoff


class Supervisor:
    def __init__(self, on_death: Callable[[str], None] | None = None) -> None:
        """on_death(name) runs in the supervisor's thread as soon as a death is noticed, before any restart."""
        self.children: dict[str, Child] = {}
        self.on_death = on_death
        self.failure: str | None = None  # set once a child is given up on
        self._on_failure: Callable[[str], None] | None = None
        self._restarting = True
        self._halt = threading.Event()
        self._halted = threading.Event()  # its thread checks no more
        self._thread: threading.Thread | None = None

    def start(self, name: str, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """Start a child now; it is watched once watch() runs."""
        return self.adopt(name, start(), start)

    def adopt(
        self, name: str, process: subprocess.Popen, restart: Callable[[], subprocess.Popen]
    ) -> subprocess.Popen:
        """Watch a child started elsewhere; restart() starts it again."""
        self.children[name] = Child(name, restart, process)
        return process

    def process(self, name: str) -> subprocess.Popen:
        return self.children[name].process

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """From now on, restart children that die; on_failure(message) runs once when one is given up on."""
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="kvserve-supervisor", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """Shutting down: a child that exits from now on is reaped and logged, not restarted."""
        self._restarting = False

    def halt(self) -> None:
        """Stop watching (and restarting) before the children are stopped."""
        self.hold()
        self._halt.set()
        if self._thread is not None:
            self._halted.wait()

    def _run(self) -> None:
        while not self._halt.wait(POLL_S):
            self.check(time.monotonic())
        self._halted.set()
        # not ended: the children this thread restarted would get their parent-death signal (SIGKILL) now,
        # before they are stopped in order. A daemon thread, it ends with the process, and they with it.
        threading.Event().wait()

    def check(self, now: float) -> None:
        """One round: reap the dead, restart those whose backoff is over."""
        for child in self.children.values():
            if child.restart_at is None:
                if child.process.poll() is not None:
                    how = f"pid {child.process.pid}, {describe_exit(child.process.returncode)}"
                    self._died(child, how, now)
            elif now >= child.restart_at and self._restarting:
                self._restart(child, now)

    def _died(self, child: Child, how: str, now: float) -> None:
        if self.on_death is not None:
            self.on_death(child.name)
        if not self._restarting:
            log.info("%s exited during shutdown (%s)", child.name, how)
            child.restart_at = float("inf")  # reaped, never again
            return
        child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(child.deaths) >= RESTART_LIMIT:
            self.failure = (
                f"{child.name} died {len(child.deaths)} times within {RESTART_WINDOW_S:.0f} s "
                f"(last: {how}): giving up on it"
            )
            log.error("%s", self.failure)
            child.restart_at = float("inf")
            self.hold()
            if self._on_failure is not None:
                self._on_failure(self.failure)
            return
        backoff = FIRST_BACKOFF_S * 2 ** (len(child.deaths) - 1)
        child.restart_at = now + backoff
        log.error(
            "%s died (%s): restarting it in %.1f s, restart %d of at most %d within %.0f s",
            child.name,
            how,
            backoff,
            len(child.deaths),
            RESTART_LIMIT - 1,
            RESTART_WINDOW_S,
        )

    def _restart(self, child: Child, now: float) -> None:
        child.restart_at = None
        try:
            child.process = child.start()
        except Exception as error:  # e.g. Redis did not answer PING: as good as a death
            self._died(child, f"failed to start again: {error}", now)
            return
        log.info("%s restarted (pid %d)", child.name, child.process.pid)


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM each process still running, wait up to timeout_s for all of them, then SIGKILL the rest."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s of SIGTERM: killing it", process.pid, timeout_s)
            process.kill()
            process.wait()
