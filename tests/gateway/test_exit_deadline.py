"""A draining gateway's process ends at its deadline even when a thread that interpreter exit joins is stuck."""

import subprocess
import sys
import time

from tests.processes import REPO

STUCK = """
import threading, time
from gateway.server.exit_deadline import exit_within
threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: interpreter exit would wait for it
exit_within(0.5)
"""


def test_a_stuck_thread_does_not_hold_the_process_past_its_deadline():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 10
    assert "exiting now" in done.stderr
