"""Back-pressure and re-routing with real processes: Redis, two executors whose queues hold one request each, two
gateways (one holding requests 30 s, one 1 s), over real HTTP. An executor at its queue bound refuses work as
busy; the gateway sends it elsewhere or holds it until some executor has room; an executor that stops or dies
loses no request the client has not seen an answer to."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx
import pytest

from shared import redis_keys as keys
from tests.gateway.answers import metric_samples, metric_total
from tests.processes import ExecutorProcess, eventually
from tests.stacks import serving_stack

# one running and one waiting request fill an executor: saturation with a handful of requests
BOUNDS = ("--max-num-seqs", "1", "--max-waiting-seqs", "1")
ENV = {"KVSERVE_CPU_KERNELS": "0"}


@contextlib.contextmanager
def running_stack(model: str, logs, executor_flags: tuple[str, ...], queue_timeouts: tuple[str, ...]):
    """(gateway base urls, executors): two executors and a gateway per queue timeout, on a Redis of their own."""
    gateways = [("--queue-timeout", timeout) for timeout in queue_timeouts]
    with serving_stack(
        model, logs, executors=2, gateways=gateways, executor_flags=executor_flags, env=ENV
    ) as stack:
        yield [g.base for g in stack.gateways], stack.executors


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """(patient gateway, impatient gateway, executors)."""
    logs = tmp_path_factory.mktemp("backpressure-logs")
    with running_stack(tiny_models["llama"], logs, BOUNDS, ("30", "1")) as ((patient, impatient), executors):
        yield patient, impatient, executors


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))


def post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    return asyncio.run(_post_all(base, bodies))


class LoadSampler:
    """Every executor's published load, read from Redis every 20 ms in a thread while a test runs."""

    def __init__(self, executors: list[ExecutorProcess]) -> None:
        self.executors = executors
        self.samples: list[dict[str, dict[str, str]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append({e.id: e.redis.hgetall(keys.load_key(e.id)) for e in self.executors})
            time.sleep(0.02)

    def __enter__(self) -> LoadSampler:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join()

    def most_waiting(self) -> int:
        return max(int(load.get("waiting", 0)) for sample in self.samples for load in sample.values())


def disconnected(base: str) -> float:
    """Requests the gateway counted as ended by their client (status 499)."""
    return metric_total(metric_samples(f"{base}/metrics"), "kvserve_requests_total", status="499")


def series(base: str, name: str) -> float:
    """One unlabelled series' value on the gateway's /metrics page."""
    return metric_samples(f"{base}/metrics")[(name, ())]


def running(executor: ExecutorProcess) -> int:
    return int(executor.redis.hget(keys.load_key(executor.id), "running") or 0)


def full(executors: list[ExecutorProcess]) -> bool:
    """Every executor holds its one waiting place for the (anonymous) tenant these tests send as: it refuses the
    tenant's next request as busy (its queue_full waits for every tenant's places, TENANTS_SHARE of them)."""
    return all(int(e.redis.hget(keys.load_key(e.id), "waiting_max_tenant") or 0) >= 1 for e in executors)


def test_requests_beyond_every_queue_wait_at_the_gateway_and_complete_when_room_frees(stack):
    patient, _, executors = stack
    held, added = "kvserve_gateway_queue_time_seconds_sum", "kvserve_gateway_added_latency_seconds_sum"
    held_before, added_before = series(patient, held), series(patient, added)
    with LoadSampler(executors) as sampler:
        # long enough that the queue's wait dwarfs the gateway's own work on a busy machine
        responses = post_all(patient, [body(f"burst {i}", 120) for i in range(10)])
    assert [r.status_code for r in responses] == [200] * 10, [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in responses)
    assert {r.headers["x-kvserve-executor"] for r in responses} == {e.id for e in executors}
    # ten requests, room for four: the rest waited at the gateway, never in an executor's queue
    assert sampler.most_waiting() <= 1
    # the wait is the queue's, not the gateway's own work: counted apart, left out of the added latency
    held_s, added_s = series(patient, held) - held_before, series(patient, added) - added_before
    assert held_s > 1.0 and added_s < held_s / 4, (held_s, added_s)


@pytest.mark.slow
def test_past_the_queue_timeout_a_held_request_gets_503_with_retry_after(stack):
    patient, impatient, executors = stack

    async def scenario() -> httpx.Response:
        # two running and two waiting fill both executors for as long as the test needs, however fast a step
        # is: requests that could run to the end of the context, given up by their client once the checks are done
        filling = asyncio.ensure_future(_post_all(patient, [body(f"long {i}", 1000) for i in range(4)]))
        while not full(executors):
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=impatient, timeout=60) as client:
            started = time.monotonic()
            refused = await client.post("/v1/completions", json=body("one too many", 4))
            assert time.monotonic() - started >= 0.9  # it was held for --queue-timeout, not refused at once
        # a client that gives up while held leaves the backlog at once, not when an executor has room
        left_before = disconnected(patient)
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=patient, timeout=0.5) as client:
                await client.post("/v1/completions", json=body("impatient client", 4))
        assert await asyncio.to_thread(eventually, lambda: disconnected(patient) > left_before, 2.0)
        assert full(executors) and not filling.done()
        filling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await filling
        return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) > 0
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "overloaded" and "queue" in error["message"]
    # the long requests' clients gone, both executors drain: the impatient gateway serves again
    assert eventually(lambda: not any(running(e) for e in executors), timeout=30)
    assert post_all(impatient, [body("after", 4)])[0].status_code == 200


def test_a_burst_across_two_executors_has_no_errors_and_uses_both(stack):
    patient, _, executors = stack
    bodies = [body(f"burst {i} " * (1 + i % 5), 8, temperature=0.7, seed=i) for i in range(24)]
    responses = post_all(patient, bodies)
    assert [r.status_code for r in responses] == [200] * 24, [
        r.text for r in responses if r.status_code != 200
    ]
    assert {r.headers["x-kvserve-executor"] for r in responses} == {e.id for e in executors}


def test_a_stopped_executor_does_not_hold_queued_work(stack):
    patient, _, executors = stack
    stopped, other = executors
    os.kill(stopped.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # the stopped one looks idle until its heartbeat expires: some of these go to it first
        responses = post_all(patient, [body(f"stop {i}", 8) for i in range(6)])
        took = time.monotonic() - started
    finally:
        os.kill(stopped.process.pid, signal.SIGCONT)
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    assert {r.headers["x-kvserve-executor"] for r in responses} == {other.id}
    assert took < keys.HEARTBEAT_TTL_S + 10
    # back from the stop, it registers again and serves
    assert eventually(lambda: stopped.redis.exists(keys.executor_key(stopped.id)), timeout=10)


@pytest.mark.slow  # a stack of its own: its executors hand back what waited a second
def test_a_request_queued_behind_a_long_one_moves_to_the_executor_that_went_idle(tiny_models, tmp_path):
    flags = (*BOUNDS, "--max-waiting-time", "1")
    with running_stack(tiny_models["llama"], tmp_path, flags, ("30",)) as ((base,), executors):

        def running(executor: ExecutorProcess) -> bool:
            return executor.redis.hget(keys.load_key(executor.id), "running") == "1"

        async def scenario() -> tuple[list[httpx.Response], float, bool]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                long = asyncio.ensure_future(client.post("/v1/completions", json=body("long", 600)))
                while not any(map(running, executors)):
                    await asyncio.sleep(0.01)
                short = asyncio.ensure_future(client.post("/v1/completions", json=body("short", 8)))
                while not all(map(running, executors)):
                    await asyncio.sleep(0.01)
                # one waits behind the long request, one behind the short one, which soon leaves its executor idle
                started = time.monotonic()
                behind = await asyncio.gather(
                    *(client.post("/v1/completions", json=body(f"w{i}", 8)) for i in (0, 1))
                )
                took, long_done = time.monotonic() - started, long.done()
                return [await long, await short, *behind], took, long_done

        responses, took, long_done = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert (
        not long_done and took < 6
    )  # not after the long request: handed back after a second, served elsewhere


def test_non_streaming_requests_of_a_killed_executor_complete_on_the_other(stack):
    """Last in this module: it kills an executor."""
    patient, _, executors = stack
    victim, survivor = executors
    # seeded sampling: a request started again elsewhere gives the answer it would have given the first time
    bodies = [body(f"killed {i}", 60, temperature=1.0, seed=100 + i) for i in range(4)]

    async def scenario() -> list[httpx.Response]:
        sent = asyncio.ensure_future(_post_all(patient, bodies))
        # mid-generation on the victim: its load says running only after the step that gave a request its first
        # token; killed at once, before a tiny model's steps could finish one (waiting longer lets some finish there)
        while int(victim.redis.hget(keys.load_key(victim.id), "running") or 0) == 0:
            await asyncio.sleep(0.01)
        victim.process.kill()
        return await sent

    responses = asyncio.run(scenario())
    victim.process.wait()
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert {r.headers["x-kvserve-executor"] for r in responses} == {survivor.id}
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses)
    again = post_all(patient, bodies)
    assert [r.json()["choices"][0]["text"] for r in again] == [
        r.json()["choices"][0]["text"] for r in responses
    ]
