"""How many threads the CPU forward pass runs on: no more than the cores other processes leave free.

torch's CPU operations, and kvkernels' with them, split each operation over OpenMP threads that meet at its end.
When another process takes a core (a load client on the same machine, a batch job, a neighbour on a Kubernetes
node), the thread sharing that core runs only in the time slices the other leaves it, and every operation waits for
it at its end. On a 2-core machine beside one busy process at niceness 19 in another session, a 512-token prefill
step took 4.8-5.6 s on 2 threads against 0.88 s on one (0.47 s on 2 threads with the machine to itself).

So after every INTERVAL_S of steps the governor looks at two things over the time since it last did:
- the time the executor's threads spent runnable and waiting for a core (/proc/self/task/*/schedstat): more than
  DROP_DELAY seconds for each second of steps, and it runs on one thread fewer;
- the idle time of the cores it may run on (/proc/stat): more than RESTORE_IDLE of a core idle while it runs on
  fewer threads than it started with, and it takes one back. A thread given back to a core that is still shared
  comes off again at the next look; each such round trip doubles the wait before the next try (up to MAX_HOLD_S).

A step that follows a pause (INTERVAL_S or more, nearly without steps) is looked at before it runs, from the cores'
idle time alone: in the pause the engine's threads took nothing, so the cores other processes did not leave idle
are theirs. Fewer than the threads less half a core left idle, one thread fewer before the step; more than the
threads and RESTORE_IDLE, one back. A load client that builds its requests before it sends them (GuideLLM does, for
about 20 s) then meets a first step on one thread, not a 4-5 s one on two.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from kvkernels.cpu_extension import cpu_kernels, kernels_enabled

log = logging.getLogger("kvserve.engine")

INTERVAL_S = 0.5
DROP_DELAY = 0.5  # seconds of waiting for a core per second: past this, one thread fewer runs faster
RESTORE_IDLE = 0.75  # cores idle on average: a whole one nearly free
MAX_HOLD_S = 8.0
PAUSE_BUSY = 0.1  # a pause: steps took at most this share of the time since the last look


def run_delay_s() -> float:
    """Seconds the process's threads (those alive now) have spent runnable but waiting for a core."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # the thread ended while we looked
    return total / 1e9


def idle_s(cpus: frozenset[int] | None = None) -> float:
    """Seconds the cores this process may run on have been idle (/proc/stat's idle and iowait) since boot."""
    cpus = frozenset(os.sched_getaffinity(0)) if cpus is None else cpus
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                total += int(fields[3]) + int(fields[4])
    return total / ticks


def readable() -> bool:
    """Whether this system shows both (Linux with scheduler statistics)."""
    try:
        run_delay_s()
        idle_s()
        with open("/proc/self/schedstat") as f:
            return len(f.read().split()) >= 2
    except (OSError, ValueError):
        return False


class CpuThreads:
    """Sets torch's thread count from what the cores show; after_step() is called on the thread that runs steps
    (OpenMP's thread count belongs to the thread that starts the parallel regions)."""

    def __init__(
        self,
        max_threads: int,
        delay: Callable[[], float] = run_delay_s,
        idle: Callable[[], float] = idle_s,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads = self.threads = max_threads
        self._delay, self._idle, self._clock, self._set = delay, idle, clock, set_threads
        self._last = (clock(), delay(), idle())
        self._busy = 0.0  # seconds of steps since the last look
        self._hold_s = INTERVAL_S  # the wait after a drop before a thread may come back
        self._restore_after = 0.0
        self._restored = False  # the last change gave a thread back

    def before_step(self) -> None:
        """A step is about to run; after a pause, look first."""
        now = self._clock()
        paused = now - self._last[0]
        if paused >= INTERVAL_S and self._busy <= PAUSE_BUSY * paused:
            self._look(now, after_steps=False)

    def after_step(self, seconds: float) -> None:
        """A step took seconds; once the steps since the last look add up to INTERVAL_S, look again."""
        self._busy += seconds
        if self._busy >= INTERVAL_S:
            self._look(self._clock(), after_steps=True)

    def _look(self, now: float, after_steps: bool) -> None:
        delay, idle = self._delay(), self._idle()
        then, delay_then, idle_then = self._last
        self._last = (now, delay, idle)
        idle_cores = max(0.0, idle - idle_then) / max(now - then, 1e-9)
        if after_steps:
            # waiting per second of steps, not of wall time: between steps the threads sleep and wait for nothing
            waited = (
                max(0.0, delay - delay_then) / self._busy
            )  # (a thread that ended takes its delay with it)
            crowded, why = (
                waited > DROP_DELAY,
                f"its threads waited {waited:.2f} s for a core per second of steps",
            )
            spare = idle_cores  # the threads ran: what stayed idle was left over
        else:
            spare = (
                idle_cores - self.threads
            )  # the threads slept: they would have taken that many of the idle ones
            crowded, why = spare < -0.5, f"other processes kept {idle_cores:.2f} cores idle during a pause"
        self._busy = 0.0
        if self.threads > 1 and crowded:
            # a round trip (given back, taken off) waits twice as long before the next try
            self._hold_s = min(2 * self._hold_s, MAX_HOLD_S) if self._restored else INTERVAL_S
            self._restore_after = now + self._hold_s
            self._change(self.threads - 1, why)
        elif self.threads < self.max_threads and spare > RESTORE_IDLE and now >= self._restore_after:
            self._change(self.threads + 1, f"{spare:.2f} cores idle beyond its threads")
        elif self.threads == self.max_threads:
            self._hold_s = max(INTERVAL_S, self._hold_s / 2)  # the cores stayed free: try sooner next time

    def _change(self, threads: int, why: str) -> None:
        self._restored = threads > self.threads
        self.threads = threads
        self._set(threads)
        log.info("CPU forward pass on %d of %d threads: %s", threads, self.max_threads, why)


def cpu_threads_for(enabled: bool, device: torch.device, dtype: torch.dtype) -> CpuThreads | None:
    """The governor for an engine on device, or None: off, not the CPU, one thread, no scheduler statistics, or
    a forward pass not on the C++ kernels. Those split work by output, so a result is the same on any number of
    threads; torch's own CPU ops (bfloat16, KVSERVE_CPU_KERNELS=0) round differently on one thread than on two,
    and a seeded request would then answer differently as the machine's load moved the thread count."""
    if not enabled or device.type != "cpu" or torch.get_num_threads() < 2 or not readable():
        return None
    if dtype != torch.float32 or not kernels_enabled() or cpu_kernels() is None:
        return None
    return CpuThreads(torch.get_num_threads())
