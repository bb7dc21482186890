"""The grammar compiler's own processes, and their parent's handles on them.

A compile runs inside the library's C++ code for as long as the grammar asks (a regex's time grows with the square
of its length: half an hour at 6 KB) and no thread can stop it, but a process can be killed. So each grammar is
compiled first in a compile process under a deadline, and one that overruns is killed. Killing must be cheap (the
fast lane kills one every time a grammar outgrows its budget), and a fresh interpreter is not: importing the
library (torch with it) takes seconds. So one *fork server* is started once, `python -m
executor.structured.grammar_worker`: a fresh interpreter (the executor runs torch's threads, and a fork of it would
copy the locks they hold; multiprocessing's spawn would also run the parent's main script again, which an offline
script without a main guard does not survive), at a lower CPU priority (it takes what the engine leaves), sent the
tokenizer info once as the library's JSON. It never compiles: for each compile process asked of it, it forks one
(milliseconds, sharing its imports and tokenizer info) and hands it the socket the parent sent along. A compile
process takes one spec at a time and answers whether it compiled. It does not send the compiled grammar back: the
library's only format is JSON of every token mask, 10-50x slower to write than the compile, so the parent compiles a
spec again once a compile process has shown it fits the deadline. Nothing outlives the executor: between compiles
a closed pipe ends a process; on Linux the kernel kills the fork server when the parent's thread that started it
(a compile thread, which lives as long as the executor's grammars) ends, crashes included, and each compile process
when the fork server ends.
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

from shared.child_env import python_environment
from shared.parent_death import die_with_parent
from shared.structured_outputs import StructuredOutputsParams

NICENESS = 10  # added to the executor's nice value for compiles: the engine's threads come first for the CPU
START_TIMEOUT_S = 120.0  # a fresh interpreter importing the library (and torch with it) on a loaded machine
FORK_TIMEOUT_S = (
    30.0  # the fork server forking one compile process (milliseconds when the machine is not swapping)
)
_READY, _COMPILED, _REFUSED = "ready", "compiled", "refused"
_FORK = b"f"  # a request to the fork server; the socket for the new process rides along


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
    """A compile process could not start, or died."""


class ForkServer:
    """The parent's side of the fork server: started on the first process asked of it (or start()), started
    again when it died. Used from several threads."""

    def __init__(self, tokenizer_info_json: str, niceness: int) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self.niceness = niceness
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    def start(self) -> None:
        """Start the server, unless it runs, and wait until it holds the tokenizer info; WorkerFailed when it does
        not. On Linux it dies with the calling thread: call it from one that lives as long as the grammars."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._stop()
        here, there = socket.socketpair()
        # only what runs Python (it compiles clients' grammars: no Redis URL, no secret of the executor's), and the
        # parent's import path, whatever put it there (an editable install, pytest's rootdir, PYTHONPATH)
        env = {**python_environment(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
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
            self._stop()
            raise WorkerFailed(f"the grammar compile process did not start within {START_TIMEOUT_S:g} s")
        self._receive()

    def fork(self) -> tuple[int, Connection]:
        """A new compile process, ready for specs: its pid (the server's child, reaped by the server) and the
        parent's end of its pipe. WorkerFailed when the server cannot be started or dies meanwhile."""
        with self._lock:
            self._start()
            here, there = socket.socketpair()
            try:
                with socket.socket(fileno=os.dup(self._conn.fileno())) as control:
                    socket.send_fds(control, [_FORK], [there.fileno()])
                if not self._conn.poll(FORK_TIMEOUT_S):
                    self._stop()
                    raise WorkerFailed(
                        f"the grammar compile process did not start within {FORK_TIMEOUT_S:g} s"
                    )
                _, pid = self._receive()
            except OSError:  # the server died a moment ago
                here.close()
                self._stop()
                raise WorkerFailed("the grammar compile process stopped") from None
            except WorkerFailed:
                here.close()
                raise
            finally:
                there.close()
        return int(pid), Connection(here.detach())

    def _receive(self) -> tuple[str, str]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # it died before it answered
            exit_code = self._stop()
            raise WorkerFailed(f"the grammar compile process stopped (exit code {exit_code})") from None

    def stop(self) -> None:
        """Kill the server (its compile processes die with it) and reap it."""
        with self._lock:
            self._stop()

    def _stop(self) -> int | None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None:
            return None
        process.kill()
        conn.close()
        return process.wait()


class GrammarWorker:
    """One lane's compile process, forked on the first compile, killed when a compile overruns and forked again
    by the next. Used from one thread, but kill() may come from any."""

    def __init__(self, server: ForkServer) -> None:
        self._server = server
        self._pid: int | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The compile process's id; None when there is none."""
        return self._pid

    def start(self) -> None:
        """Fork a compile process, unless one is there (it may have died idle: the next send says so)."""
        if self._conn is None:
            self._pid, self._conn = self._server.fork()

    def try_compile(self, spec: StructuredOutputsParams, timeout_s: float) -> None:
        """Returns once the spec has compiled within timeout_s. ValueError naming the field when the library
        refuses it; CompileTimeout when it took longer (the process is killed); WorkerFailed when the process
        could not start or died."""
        self.start()
        try:
            self._conn.send(spec)
            if not self._conn.poll(timeout_s):
                self.stop()
                raise CompileTimeout(f"compiling took longer than {timeout_s:g} s")
            status, message = self._conn.recv()
        except (EOFError, OSError):  # it died (or was killed by kill()) before it answered
            self.stop()
            raise WorkerFailed("the grammar compile process stopped") from None
        if status == _REFUSED:
            raise ValueError(message)

    def kill(self) -> None:
        """End the process now, from any thread: a compile waiting on it sees the pipe close at once."""
        pid = self._pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill the process and close the pipe (the fork server reaps it)."""
        self.kill()
        conn, self._conn, self._pid = self._conn, None, None
        if conn is not None:
            conn.close()


# --- the processes' side ------------------------------------------------------------------------------------


def serve(conn: Connection, parent_pid: int, niceness: int) -> None:
    """The fork server's life: the tokenizer info, then a compile process forked for each socket the pipe
    brings, until the pipe closes."""
    # mid-fork nothing reads the pipe: on Linux the kernel kills this process with its parent's starting thread
    if not die_with_parent(parent_pid):
        os._exit(0)
    # Ctrl-C at a terminal reaches its whole process group: the parent decides when this one ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getpriority(os.PRIO_PROCESS, 0) < niceness:  # on Linux it comes with it from the compile thread
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    # here, not at the top: the executor imports this module whether or not the library is installed
    import xgrammar as xgr

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the compile processes
        # forking is safe here: besides this thread there is only the one torch's import leaves, idle on a
        # condition variable (it holds no lock a child could inherit taken)
        conn.send((_READY, ""))
        server_pid = os.getpid()
        with socket.socket(fileno=os.dup(conn.fileno())) as control:
            while True:
                message, fds, _, _ = socket.recv_fds(control, len(_FORK), 1)
                if message != _FORK or len(fds) != 1:
                    return  # the pipe closed (or someone else wrote to it)
                pid = os.fork()
                if pid == 0:  # the child never returns into this loop, whatever happens in it
                    try:
                        control.close()
                        conn.close()
                        _compile_process(Connection(fds[0]), info, server_pid)
                    finally:
                        os._exit(0)
                os.close(fds[0])
                conn.send((_READY, pid))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent closed its end, or is gone
        return


def _compile_process(conn: Connection, info, server_pid: int) -> None:
    """A compile process's life: each spec the pipe brings, answered, until the pipe closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if not die_with_parent(server_pid):
        return
    import xgrammar as xgr

    from executor.structured.grammar_compile import compile_spec

    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        while True:
            spec = conn.recv()
            try:
                compile_spec(compiler, spec)
                reply = (_COMPILED, "")
            except ValueError as error:
                reply = (_REFUSED, str(error))
            conn.send(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
