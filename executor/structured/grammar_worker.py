"""The grammar compiler's own process, and its parent's handle on it.

A compile runs inside the library's C++ code for as long as the grammar asks (a regex's time grows with the square
of its length: half an hour at 6 KB) and no thread can stop it, but a process can be killed. So each grammar is
compiled first in one worker process, `python -m executor.structured.grammar_worker`, under a deadline: a fresh
interpreter (the executor runs torch's threads, and a fork would copy the locks they hold; multiprocessing's spawn
would also run the parent's main script again, which an offline script without a main guard does not survive), at
a lower CPU priority (it takes what the engine leaves), sent the tokenizer info once as the library's JSON and
then one spec at a time, answering whether it compiled. It does not send the compiled grammar back: the library's
only format is JSON of every token mask, 10-50x slower to write than the compile, so the parent compiles a spec
again once the worker has shown it fits the deadline. It never outlives the executor: between compiles the pipe's
closing ends it; during one, on Linux, the kernel kills it when the parent's thread that started it (the compile
thread, which lives as long as the executor's grammars) ends, crashes included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from shared.parent_death import die_with_parent
from shared.structured_outputs import StructuredOutputsParams

NICENESS = 10  # added to the executor's nice value for compiles: the engine's threads come first for the CPU
START_TIMEOUT_S = 120.0  # a fresh interpreter importing the library (and torch with it) on a loaded machine
_READY, _COMPILED, _REFUSED = "ready", "compiled", "refused"


def compile_niceness() -> int:
    """The nice value compiles run at: NICENESS above the calling thread's (the executor's own)."""
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)


def lower_thread_priority(niceness: int) -> None:
    """The calling thread to niceness, where a thread has a nice value of its own (Linux); elsewhere it would be
    the whole executor's, so nothing changes."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


class CompileTimeout(Exception):
    """A compile ran past its deadline; the process running it has been killed."""


class WorkerFailed(RuntimeError):
    """The worker process could not start, or died; exit_code is its own, None when it did not start."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class GrammarWorker:
    """The parent's side: one process at a time, started on the first compile (or start()), killed when a compile
    overruns and started again by the next. Used from one thread, but kill() may come from any."""

    def __init__(self, tokenizer_info_json: str, niceness: int) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self.niceness = niceness
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The running process's id; None when there is none."""
        process = self._process
        return process.pid if process is not None else None

    def start(self) -> None:
        """Start a process, unless one runs, and wait until it holds the tokenizer info; WorkerFailed when it
        does not. One that died while idle is reaped and replaced."""
        if self._process is not None and self._process.poll() is None:
            return
        self.stop()
        here, there = socket.socketpair()
        # the parent's import path, whatever put it there (an editable install, pytest's rootdir, PYTHONPATH)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "executor.structured.grammar_worker"),
                    *(str(there.fileno()), str(os.getpid()), str(self.niceness)),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=[there.fileno()],
                env=env,
            )
        except OSError as error:
            here.close()
            raise WorkerFailed(f"the grammar compile process did not start: {error}") from None
        finally:
            there.close()
        self._process, self._conn = process, Connection(here.detach())
        with contextlib.suppress(OSError):  # it died already: the read below says how
            self._conn.send_bytes(self._tokenizer_info_json.encode())
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise WorkerFailed(f"the grammar compile process did not start within {START_TIMEOUT_S:g} s")
        self._receive()

    def try_compile(self, spec: StructuredOutputsParams, timeout_s: float) -> None:
        """Returns once the spec has compiled within timeout_s. ValueError naming the field when the library
        refuses it; CompileTimeout when it took longer (the process is killed); WorkerFailed when the process
        could not start or died."""
        self.start()
        try:
            self._conn.send(spec)
        except OSError:  # it died a moment ago
            exit_code = self.stop()
            raise WorkerFailed(
                f"the grammar compile process stopped (exit code {exit_code})", exit_code
            ) from None
        if not self._conn.poll(timeout_s):
            self.stop()
            raise CompileTimeout(f"compiling took longer than {timeout_s:g} s")
        status, message = self._receive()
        if status == _REFUSED:
            raise ValueError(message)

    def _receive(self) -> tuple[str, str]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # it died (or was killed by kill()) before it answered
            exit_code = self.stop()
            raise WorkerFailed(
                f"the grammar compile process stopped (exit code {exit_code})", exit_code
            ) from None

    def kill(self) -> None:
        """End the process now, from any thread: a compile waiting on it sees the pipe close at once."""
        process = self._process
        if process is not None:
            process.kill()

    def stop(self) -> int | None:
        """Kill the process, reap it, close the pipe; its exit code (None when none ran)."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None:
            return None
        process.kill()
        conn.close()
        return process.wait()


def serve(conn: Connection, parent_pid: int, niceness: int) -> None:
    """The worker process's life: the tokenizer info, then each spec the pipe brings, until the pipe closes."""
    # mid-compile nothing reads the pipe: on Linux the kernel kills this process with its parent's starting
    # thread; elsewhere it ends at the next read of the pipe, once the compile is over
    if not die_with_parent(parent_pid):
        os._exit(0)
    # Ctrl-C at a terminal reaches its whole process group: the parent decides when this one ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getpriority(os.PRIO_PROCESS, 0) < niceness:  # on Linux it comes with it from the compile thread
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    # here, not at the top: the executor imports this module whether or not the library is installed
    import xgrammar as xgr

    from executor.structured.grammar_compile import compile_spec

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        conn.send((_READY, ""))
        while True:
            spec = conn.recv()
            try:
                compile_spec(compiler, spec)
                reply = (_COMPILED, "")
            except ValueError as error:
                reply = (_REFUSED, str(error))
            conn.send(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent closed its end, or is gone
        return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
