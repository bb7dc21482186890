"""The backlog's two waits: in turn while every executor is full, out of turn for a request refused as busy."""

import asyncio
import time

import pytest

from gateway.api_error import APIError
from gateway.backlog import FIRST_BACKOFF_S, Backlog
from gateway.index_reader import ExecutorInfo
from gateway.router import Choice, Saturated

EXECUTOR = ExecutorInfo("e1", "tcp://127.0.0.1:1", "tiny", 16, 1024)


class OneExecutor:
    """A router over one executor that always publishes room: only avoid (a busy refusal) can skip it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, frozenset]] = []  # (who, avoid) per call

    async def choose(self, ids, cache_salt, exclude=frozenset(), avoid=frozenset()):
        self.asked.append((cache_salt, frozenset(avoid)))
        if EXECUTOR.executor_id in avoid:
            raise Saturated()
        return Choice(EXECUTOR, [], 0, 0, 0.0, "least_loaded")


def test_a_refused_request_backs_off_without_holding_up_others():
    async def scenario():
        router = OneExecutor()
        backlog = Backlog(router, timeout_s=30)
        refused = asyncio.create_task(
            backlog.choose([1], "alpha", time.monotonic(), avoid={"e1"}, refusals=4)
        )
        await asyncio.sleep(0)  # alpha has asked once, skipping e1, and is pausing
        assert router.asked == [("alpha", frozenset({"e1"}))] and backlog.waiting == 0
        newcomer = await asyncio.wait_for(backlog.choose([2], "beta", time.monotonic()), 0.1)
        assert newcomer.executor is EXECUTOR and not refused.done()  # beta did not wait behind alpha
        choice = await refused
        assert choice.executor is EXECUTOR
        assert router.asked[-1] == ("alpha", frozenset())  # after its pause, e1 may be asked again
        return choice

    asyncio.run(scenario())


def test_the_pause_doubles_with_each_refusal_and_respects_the_deadline():
    async def timed(refusals: int) -> float:
        backlog = Backlog(OneExecutor(), timeout_s=30)
        started = time.monotonic()
        await backlog.choose([1], "alpha", started, avoid={"e1"}, refusals=refusals)
        return time.monotonic() - started

    assert asyncio.run(timed(0)) >= FIRST_BACKOFF_S
    assert asyncio.run(timed(3)) >= 8 * FIRST_BACKOFF_S

    async def late():
        backlog = Backlog(OneExecutor(), timeout_s=1)
        await backlog.choose([1], "alpha", time.monotonic() - 0.99, avoid={"e1"}, refusals=5)

    with pytest.raises(APIError) as refused:
        asyncio.run(late())
    assert refused.value.status == 503
