"""The backlog's two waits: in its tenant's line while no executor has room for it, out of turn for a request
refused as busy; and the router's room, counted per tenant."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.api_error import APIError
from gateway.routing.backlog import FIRST_BACKOFF_S, Backlog
from gateway.routing.cost import Candidate
from gateway.routing.index_reader import ExecutorInfo
from gateway.routing.router import Choice, Router, Saturated
from shared.tenant import Tenant

EXECUTOR = ExecutorInfo("e1", "tcp://127.0.0.1:1", "tiny", 16, 1024)
ALPHA, BETA = Tenant("alpha", "alpha-salt"), Tenant("beta", "beta-salt")


class OneExecutor:
    """A router over one executor that always publishes room: only avoid (a busy refusal) can skip it."""

    places_per_tenant = True

    def __init__(self) -> None:
        self.asked: list[tuple[str, frozenset]] = []  # (who, avoid) per call

    async def choose(self, ids, tenant, exclude=frozenset(), avoid=frozenset(), adapter=None):
        self.asked.append((tenant.name, frozenset(avoid)))
        if EXECUTOR.executor_id in avoid:
            raise Saturated()
        return Choice(EXECUTOR, [], 0, 0, 0.0, "least_loaded")


def test_a_refused_request_backs_off_without_holding_up_others():
    async def scenario():
        router = OneExecutor()
        backlog = Backlog(router, timeout_s=30)
        refused = asyncio.create_task(backlog.choose([1], ALPHA, time.monotonic(), avoid={"e1"}, refusals=4))
        await asyncio.sleep(0)  # alpha has asked once, skipping e1, and is pausing
        assert router.asked == [("alpha", frozenset({"e1"}))] and backlog.waiting == 0
        newcomer = await asyncio.wait_for(backlog.choose([2], BETA, time.monotonic()), 0.1)
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
        await backlog.choose([1], ALPHA, started, avoid={"e1"}, refusals=refusals)
        return time.monotonic() - started

    assert asyncio.run(timed(0)) >= FIRST_BACKOFF_S
    assert asyncio.run(timed(3)) >= 8 * FIRST_BACKOFF_S

    async def late():
        backlog = Backlog(OneExecutor(), timeout_s=1)
        await backlog.choose([1], ALPHA, time.monotonic() - 0.99, avoid={"e1"}, refusals=5)

    with pytest.raises(APIError) as refused:
        asyncio.run(late())
    assert refused.value.status == 503


class PlacesPerTenant:
    """A router over one executor with places for some tenants only (room[tenant] requests more)."""

    def __init__(self, room: dict[str, int], places_per_tenant: bool = True) -> None:
        self.places_per_tenant = places_per_tenant
        self.room = room
        self.chosen: list[tuple[str, int]] = []  # (tenant, ids[0]) in the order they got a place

    async def choose(self, ids, tenant, exclude=frozenset(), avoid=frozenset(), adapter=None):
        if self.room.get(tenant.name, 0) <= 0:
            raise Saturated()
        self.room[tenant.name] -= 1
        self.chosen.append((tenant.name, ids[0]))
        return Choice(EXECUTOR, [], 0, 0, 0.0, "least_loaded")


def test_a_tenants_burst_waits_in_its_own_line_and_another_tenant_goes_first():
    async def scenario():
        router = PlacesPerTenant({"alpha": 0, "beta": 1})
        backlog = Backlog(router, timeout_s=30)
        burst = [asyncio.create_task(backlog.choose([i], ALPHA, time.monotonic())) for i in range(5)]
        await asyncio.sleep(0.05)
        assert backlog.waiting == 5 and router.chosen == []
        # beta has a place: it gets it at once, not behind alpha's five
        await asyncio.wait_for(backlog.choose([100], BETA, time.monotonic()), 0.1)
        assert router.chosen == [("beta", 100)] and backlog.waiting == 5
        router.room["alpha"] = 5  # places free for alpha: its line goes in arrival order
        backlog.freed()
        await asyncio.wait_for(asyncio.gather(*burst), 5)
        assert router.chosen[1:] == [("alpha", i) for i in range(5)] and backlog.waiting == 0

    asyncio.run(scenario())


def test_executors_with_one_bound_for_all_get_one_line_first_come_first_served():
    async def scenario():
        router = PlacesPerTenant({"alpha": 0, "beta": 0}, places_per_tenant=False)
        backlog = Backlog(router, timeout_s=30)
        alpha = asyncio.create_task(backlog.choose([1], ALPHA, time.monotonic()))
        await asyncio.sleep(0.02)
        beta = asyncio.create_task(backlog.choose([2], BETA, time.monotonic()))
        await asyncio.sleep(0.02)
        router.room["beta"] = 1  # room for beta alone: it still waits behind alpha, first in the one line
        backlog.freed()
        await asyncio.sleep(0.1)
        assert router.chosen == [] and not beta.done()
        router.room["alpha"] = 1
        backlog.freed()
        await asyncio.wait_for(asyncio.gather(alpha, beta), 5)
        assert router.chosen == [("alpha", 1), ("beta", 2)]

    asyncio.run(scenario())


class View:
    def __init__(self, view) -> None:
        self.view = view

    async def routing_view(self, hashes):
        return self.view


def _router(load: Candidate, share: int, sent: dict) -> Router:
    info = ExecutorInfo(
        "e1", "tcp://127.0.0.1:1", "tiny", 16, 1024, max_waiting_seqs=4, waiting_tenants_share=share
    )
    client = SimpleNamespace(
        unanswered={info.address: sum(sent.values())}, unanswered_of_tenant=sent, refused={}
    )
    return Router(View([(info, load)]), "cache_aware", client)


def test_an_executors_places_are_counted_per_tenant_and_for_all():
    def room(waiting: int, share: int, sent: dict, tenant: str) -> bool:
        load = Candidate("e1", "tcp://127.0.0.1:1", waiting=waiting)
        try:
            asyncio.run(_router(load, share, sent).choose([1, 2, 3], Tenant(tenant)))
        except Saturated:
            return False
        return True

    alpha_full = {("tcp://127.0.0.1:1", Tenant("alpha")): 4}
    assert not room(4, 4, alpha_full, "alpha")  # alpha's own four places are taken
    assert room(4, 4, alpha_full, "beta")  # beta's are not
    assert not room(16, 4, alpha_full, "beta")  # all tenants' sixteen are
    assert not room(4, 1, alpha_full, "beta")  # an executor without places per tenant: one bound for all
