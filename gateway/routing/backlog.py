"""Back-pressure at the gateway: a request no executor can start soon waits here, not in an executor's queue.

An executor's waiting queue is bounded per tenant and for all tenants together
(executor/scheduling/waiting_queue.py). The router skips executors without room for the request's tenant; when no
live one has room, the request waits in this backlog, in its tenant's line, oldest arrival first, until one has
room. Each tenant's line has one reader, its oldest request, which asks Redis (with backoff, and at once when a
request of this gateway ends), so a long backlog costs one reader per tenant waiting, and a tenant's burst waits
behind itself: another tenant's request, with places free for it, never queues behind it. Work then goes to
whichever executor frees first, never to one queue chosen at arrival. Past the deadline (--queue-timeout after
arrival) the request gets 503 with Retry-After. Executors that keep one bound for all tenants (--no-fair-share)
get one line for all, as they have one queue.

An executor may also refuse one request as busy while publishing room: its tenant has all its places waiting for
grammars to compile. Such a request tries another executor at once; with none, it waits out of turn (its own
doubling backoff, never at the head of the backlog, so it holds up no one else's request) and asks again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import time
from collections.abc import Sequence

from gateway.api_error import APIError
from gateway.routing.adapters import Adapter
from gateway.routing.router import Choice, Router, Saturated
from shared.tenant import Tenant

FIRST_BACKOFF_S = 0.01  # the oldest waiter asks Redis again after this, doubling up to MAX_BACKOFF_S
MAX_BACKOFF_S = 0.2  # an executor publishes its load every step: about this stale at worst on a CPU
MAX_BUSY_BACKOFF_S = 1.0  # a request refused as busy again and again asks at most this often
RETRY_AFTER_S = 2
ONE_LINE = object()  # the line every tenant shares when the executors have one bound for all


class Backlog:
    def __init__(self, router: Router, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s
        # per tenant, a heap by arrival: each tenant's first one asks for the tenant's line
        self._lines: dict[Tenant | object, list[tuple[float, int, asyncio.Future]]] = {}
        self._order = itertools.count()  # breaks ties between equal arrivals
        self._freed = asyncio.Event()  # set when a request ends here: some executor may have room now

    @property
    def waiting(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def freed(self) -> None:
        """A request of this gateway ended: each line's oldest waiter looks again now instead of after its
        backoff."""
        self._freed.set()

    async def choose(
        self,
        ids: Sequence[int],
        tenant: Tenant,
        arrival: float,
        exclude: set[str] = frozenset(),
        avoid: set[str] = frozenset(),
        refusals: int = 0,
        adapter: Adapter | None = None,
    ) -> Choice:
        """The router's choice among executors with room for the tenant (exclude: lost executors; avoid: ones
        that just refused as busy, the refusals-th time in a row for this request, skipped on the first look
        only); while none has, wait in the tenant's line."""
        if avoid:
            try:
                return await self.router.choose(ids, tenant, exclude, avoid, adapter)
            except Saturated:
                pass
            # no other executor has room: back off out of turn, then look like a newcomer
            left = arrival + self.timeout_s - time.monotonic()
            if left <= 0:
                raise _saturated(self.timeout_s)
            # the last pause ends at the deadline: the request is held for --queue-timeout, never refused early
            await asyncio.sleep(min(FIRST_BACKOFF_S * 2 ** min(refusals, 16), MAX_BUSY_BACKOFF_S, left))
            if time.monotonic() >= arrival + self.timeout_s:
                raise _saturated(self.timeout_s)
        if not self._lines.get(self._line(tenant)):  # with others in its line, a newcomer queues behind them
            try:
                return await self.router.choose(ids, tenant, exclude, adapter=adapter)
            except Saturated:
                pass
        tenant_line = self._line(tenant)
        deadline = arrival + self.timeout_s
        held_since = time.monotonic()
        turn = asyncio.get_running_loop().create_future()
        entry = (arrival, next(self._order), turn)
        line = self._lines.setdefault(tenant_line, [])
        heapq.heappush(line, entry)
        if line[0] is entry:
            turn.set_result(None)
        try:
            await asyncio.wait_for(asyncio.shield(turn), max(0.0, deadline - time.monotonic()))
            choice = await self._poll(ids, tenant, exclude, deadline, adapter)
            return dataclasses.replace(choice, held_s=time.monotonic() - held_since)
        except TimeoutError:
            raise _saturated(self.timeout_s) from None
        finally:
            self._leave(tenant_line, entry)

    async def _poll(
        self,
        ids: Sequence[int],
        tenant: Tenant,
        exclude: set[str],
        deadline: float,
        adapter: Adapter | None,
    ) -> Choice:
        """A line's oldest waiter's loop: ask, back off (or wake when a request ends), ask again."""
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                return await self.router.choose(ids, tenant, exclude, adapter=adapter)
            except Saturated:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), min(backoff, left))
                backoff = FIRST_BACKOFF_S
            except TimeoutError:
                backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _line(self, tenant: Tenant) -> Tenant | object:
        return tenant if self.router.places_per_tenant else ONE_LINE

    def _leave(self, line_key: Tenant | object, entry: tuple[float, int, asyncio.Future]) -> None:
        """Out of its line, however the wait ended; the line's next oldest, if any, takes its turn at once."""
        line = self._lines.get(line_key, [])
        if entry in line:
            line.remove(entry)
            heapq.heapify(line)
        if not line:
            self._lines.pop(line_key, None)
        elif not line[0][2].done():
            line[0][2].set_result(None)


def _saturated(timeout_s: float) -> APIError:
    return APIError(
        503,
        f"every executor is at its queue bound and none had room within {timeout_s:g} s; retry later",
        "server_error",
        code="overloaded",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )
