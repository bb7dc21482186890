"""The CPU thread governor: one thread fewer while the executor's threads wait for cores other processes hold, one
back when a core is idle; the rule on scripted readings, and the real readings in a process pinned to one core."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from executor import LLM, SamplingParams
from executor.cpu_threads import (
    INTERVAL_S,
    MAX_HOLD_S,
    CpuThreads,
    cpu_threads_for,
    idle_s,
    readable,
    run_delay_s,
)
from kvkernels.cpu_extension import cpu_kernels


class Machine:
    """Scripted readings: the clock, the threads' waiting for a core, the cores' idle time; each step adds to them."""

    def __init__(self) -> None:
        self.now = self.delay = self.idle = 0.0
        self.set_to: list[int] = []

    def governor(self, threads: int = 2) -> CpuThreads:
        return CpuThreads(
            threads,
            delay=lambda: self.delay,
            idle=lambda: self.idle,
            clock=lambda: self.now,
            set_threads=self.set_to.append,
        )

    def step(self, cpu: CpuThreads, seconds: float, waited_per_s: float, idle_cores: float) -> None:
        cpu.before_step()
        self.now += seconds
        self.delay += waited_per_s * seconds
        self.idle += idle_cores * seconds
        cpu.after_step(seconds)

    def pause(self, seconds: float, idle_cores: float) -> None:
        """No steps for seconds, the engine's threads asleep."""
        self.now += seconds
        self.idle += idle_cores * seconds


def test_a_thread_comes_off_while_the_threads_wait_for_cores_and_back_when_one_is_idle():
    m = Machine()
    cpu = m.governor()
    for _ in range(10):  # a quiet machine: both threads run
        m.step(cpu, 0.1, waited_per_s=0.05, idle_cores=0.1)
    assert cpu.threads == 2 and m.set_to == []
    m.step(cpu, 0.6, waited_per_s=0.9, idle_cores=0.0)  # another process holds a core
    assert cpu.threads == 1 and m.set_to == [1]
    for _ in range(20):  # it still does: on one thread nothing waits, but no core is idle either
        m.step(cpu, 0.1, waited_per_s=0.0, idle_cores=0.05)
    assert cpu.threads == 1
    for _ in range(6):  # it stopped
        m.step(cpu, 0.1, waited_per_s=0.0, idle_cores=0.95)
    assert cpu.threads == 2 and m.set_to == [1, 2]


def test_waiting_counts_per_second_of_steps_not_of_the_idle_time_between_them():
    m = Machine()
    cpu = m.governor()
    m.pause(20.0, idle_cores=2.0)  # nothing to do for 20 s on a quiet machine
    m.step(
        cpu, 4.0, waited_per_s=0.9, idle_cores=0.0
    )  # then one long step beside a process that just started
    assert m.set_to == [1]


def test_after_a_pause_the_cores_others_kept_busy_decide_before_the_step():
    m = Machine()
    cpu = m.governor()
    m.pause(10.0, idle_cores=1.8)  # the gateway and Redis took a little: both threads run the next step
    cpu.before_step()
    assert cpu.threads == 2
    m.pause(
        10.0, idle_cores=1.0
    )  # a client builds its requests on one core: the step after runs on the other
    cpu.before_step()
    assert m.set_to == [1]
    m.step(cpu, 1.0, waited_per_s=0.0, idle_cores=0.0)  # while it lasts, one thread
    assert cpu.threads == 1
    m.pause(
        10.0, idle_cores=1.2
    )  # one core idle, the other the client's: the engine's thread would take the idle one
    cpu.before_step()
    assert cpu.threads == 1
    m.pause(10.0, idle_cores=1.95)  # the client is done
    cpu.before_step()
    assert m.set_to == [1, 2]
    m.step(cpu, 0.1, waited_per_s=0.0, idle_cores=0.0)
    cpu.before_step()  # steps since: not a pause
    assert cpu.threads == 2


def test_no_look_before_interval_s_of_steps():
    m = Machine()
    cpu = m.governor()
    m.step(cpu, INTERVAL_S / 2, waited_per_s=1.0, idle_cores=0.0)
    assert cpu.threads == 2
    m.step(cpu, INTERVAL_S / 2, waited_per_s=1.0, idle_cores=0.0)
    assert cpu.threads == 1


def test_each_round_trip_waits_twice_as_long_before_the_next_try_up_to_max_hold():
    m = Machine()
    cpu = m.governor()
    holds = []
    for _ in range(7):
        m.step(cpu, INTERVAL_S, waited_per_s=0.9, idle_cores=0.0)  # given back to a core still shared: off
        assert cpu.threads == 1
        dropped_at = m.now
        while cpu.threads == 1:  # the other process pauses now and then: a core looks idle at every look
            m.step(cpu, INTERVAL_S, waited_per_s=0.0, idle_cores=0.9)
        holds.append(m.now - dropped_at)
    assert holds == [INTERVAL_S, 1.0, 2.0, 4.0, 8.0, MAX_HOLD_S, MAX_HOLD_S]


def test_one_thread_at_a_time_from_many():
    m = Machine()
    cpu = m.governor(threads=4)
    for expected in (3, 2, 1, 1):
        m.step(cpu, INTERVAL_S, waited_per_s=0.8, idle_cores=0.0)
        assert cpu.threads == expected
    for expected in (2, 3, 4):  # three cores go idle: the threads come back one look at a time
        m.step(cpu, INTERVAL_S, waited_per_s=0.0, idle_cores=3.0)
        assert cpu.threads == expected
    m.step(cpu, INTERVAL_S, waited_per_s=0.0, idle_cores=3.0)
    assert cpu.threads == 4 and m.set_to == [3, 2, 1, 2, 3, 4]


@pytest.mark.skipif(not readable(), reason="no scheduler statistics (Linux /proc) here")
def test_the_readings_are_the_kernels_counters():
    before_delay, before_idle = run_delay_s(), idle_s()
    assert 0 <= before_delay <= run_delay_s() and 0 <= before_idle <= idle_s()
    assert idle_s(frozenset()) == 0


def test_no_governor_off_the_cpu_or_when_off_or_off_the_cpu_kernels(monkeypatch):
    cpu, f32 = torch.device("cpu"), torch.float32
    assert cpu_threads_for(False, cpu, f32) is None
    assert cpu_threads_for(True, torch.device("cuda"), f32) is None
    # torch's own ops round differently on another thread count: a seeded answer would move with the load
    assert cpu_threads_for(True, cpu, torch.bfloat16) is None
    if readable() and torch.get_num_threads() >= 2 and cpu_kernels() is not None:
        assert cpu_threads_for(True, cpu, f32).max_threads == torch.get_num_threads()
        monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
        assert cpu_threads_for(True, cpu, f32) is None


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")
def test_a_seeded_answer_is_the_same_on_one_thread_as_on_two(tiny_models):
    """What lets the governor move the thread count: the C++ kernels' results do not depend on it."""
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    prompts = [f"killed {i}" for i in range(4)]
    threads = torch.get_num_threads()
    answers = []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            answers.append(
                [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
            )
    finally:
        torch.set_num_threads(threads)
    assert answers[0] == answers[1]


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")
def test_long_contexts_of_the_default_shapes_answer_alike_on_one_to_four_threads(default_shaped_model):
    """The default model's heads with contexts of 1-3k positions, which decode attention cuts into parts: greedy
    and seeded answers, and each token's log-probabilities, the same bits on 1, 2, 3 and 4 threads."""
    llm = LLM(
        default_shaped_model,
        device="cpu",
        kv_cache_memory="64MiB",
        max_model_len=2304,
        enable_prefix_caching=False,
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (700, 2100)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=3)
    threads = torch.get_num_threads()
    answers = []
    try:
        for n in (1, 2, 3, 4):  # each request alone: one stream is where a cut by threads would fall
            torch.set_num_threads(n)
            outputs = [llm.generate([p], sp)[0] for sp in (greedy, seeded) for p in prompts]
            answers.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    finally:
        torch.set_num_threads(threads)
    assert all(len(tokens) == 8 for tokens, _ in answers[0])
    assert answers[1:] == answers[:1] * 3


@pytest.mark.skipif(not readable() or not hasattr(os, "sched_setaffinity"), reason="Linux scheduler needed")
def test_two_threads_on_one_core_drop_to_one():
    """In a process pinned to one core, torch's two threads take turns at it: each waits about half the time, and
    the governor, reading the real counters, takes one off; with the core never idle, it does not come back."""
    script = textwrap.dedent(
        """
        import os, time
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import torch
        torch.set_num_threads(2)
        from executor.cpu_threads import CpuThreads
        cpu = CpuThreads(2)
        a = torch.randn(384, 384)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            for _ in range(20):
                a = torch.tanh(a @ a)
            cpu.after_step(time.perf_counter() - started)
        print(cpu.threads, torch.get_num_threads())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["1", "1"], out.stderr
