"""Child processes that die with the process that started them, even when it is SIGKILLed and cleans nothing
up (`kvserve up`'s executors and embedded valkey-server).

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) does it. It is set in the child (die_with_parent): by a
Python child itself (the executor's grammar worker), or by a tiny Python wrapper that then execs the real command
(the setting survives exec, so it serves valkey-server too): a preexec_fn would do it in the forked child, but is
unsafe in a process with threads. Linux sends the signal when the *thread* that started the child ends, not its
process: start children from the main thread or from one that lives as long as the process. Elsewhere than Linux,
commands run as given.

    python -m shared.parent_death PARENT_PID COMMAND [ARG...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def dying_with_this_process(command: list[str]) -> list[str]:
    """command, wrapped so that it gets SIGKILL when this process ends."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-m", "shared.parent_death", str(os.getpid()), *command]


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when the thread that started it ends (Linux; elsewhere nothing is
    asked). Whether parent_pid is still its parent: if not, it died before the ask, and nobody will send it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent_pid


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    if not die_with_parent(parent):
        sys.exit(f"shared.parent_death: parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
