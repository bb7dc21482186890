"""A gateway process that began to drain ends within its grace period plus EXIT_MARGIN_S, whatever it still runs.

A request stuck in CPU work (in a prompt worker thread, which interpreter exit joins, or in the event loop
itself) could keep `kvserve up` alive for minutes after uvicorn finished. Past the deadline the process exits at
once, with code 1; `kvserve up`'s children die with it (shared/parent_death.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("kvserve.gateway")

# after the grace period: uvicorn's cut-off of what still runs, then `kvserve up` stopping its executors
# (kvserve/local_stack.py STOP_TIMEOUT_S) and its Redis
EXIT_MARGIN_S = 6.0


def exit_within(seconds: float) -> threading.Timer:
    """From now, this process has `seconds` to end on its own; then it exits with code 1."""
    timer = threading.Timer(seconds, _exit_now, (seconds,))
    timer.daemon = True  # a process that ends in time is not held by it
    timer.start()
    return timer


def _exit_now(seconds: float) -> None:
    log.error("still running %.0f s after the drain began: exiting now", seconds)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
