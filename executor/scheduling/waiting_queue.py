"""Requests waiting to start: a queue per tenant, and the places each tenant may hold.

Within a tenant, a lower priority value goes first (vLLM's `priority`), then first come first served; a preempted
request goes back first in its tenant's line. Which tenant's turn it is, is the scheduler's
(executor/scheduling/fair_share.py). A tenant holds at most --max-waiting-seqs places (and --max-waiting-tokens
prompt tokens to prefill), all tenants together TENANTS_SHARE times that: a tenant's burst fills its own places,
and another tenant's request still finds one. With fair share off, every request queues as one tenant, the
anonymous one: one line, one bound.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Collection, Iterable, Iterator

from executor.request import Request
from shared.tenant import ANONYMOUS_TENANT, Tenant

# places of all tenants together, as a multiple of one tenant's: enough for a few tenants' bursts at once, while the
# queue a new request waits behind stays a few steps long (it is also the bound on requests compiling their grammars)
TENANTS_SHARE = 4
_REQUEUED = (-math.inf, 0)  # the rank of a preempted request: ahead of every arrival of its tenant


class WaitingQueue:
    def __init__(
        self, fair_share: bool = True, max_seqs: int | None = None, max_tokens: int | None = None
    ) -> None:
        self.fair_share = fair_share
        self.max_seqs = max_seqs  # one tenant's places; None: no bound (the offline API queues everything)
        self.max_tokens = max_tokens  # one tenant's prompt tokens to prefill; None: no bound
        self._queues: dict[Tenant, deque[Request]] = {}  # tenants with requests waiting
        self._ranks: dict[Request, tuple[float, int]] = {}  # every request waiting: (priority, arrival)
        self._arrivals = itertools.count()

    def tenant_of(self, request: Request) -> Tenant:
        """The tenant a request queues and is served as: its own, or with fair share off the anonymous one, as
        every request is then."""
        return request.tenant if self.fair_share else ANONYMOUS_TENANT

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, request: Request) -> bool:
        return request in self._ranks

    def __iter__(self) -> Iterator[Request]:
        """Every request waiting, tenant by tenant, each tenant's in its order."""
        return itertools.chain.from_iterable(list(self._queues.values()))

    def tenants(self) -> Iterable[Tenant]:
        return self._queues.keys()

    def first(self, tenant: Tenant, passed: Collection[Request] = ()) -> Request | None:
        """The request of tenant's that starts next, of those not passed over (None: every one is)."""
        return next((r for r in self._queues[tenant] if r not in passed), None)

    def add(self, request: Request) -> None:
        """A new arrival: after its tenant's requests of the same or a lower priority value."""
        rank = (request.priority, next(self._arrivals))
        queue = self._queues.setdefault(self.tenant_of(request), deque())
        i = len(queue)
        while i and self._ranks[queue[i - 1]] > rank:
            i -= 1
        queue.insert(i, request)
        self._ranks[request] = rank

    def requeue(self, request: Request) -> None:
        """A preempted request: first in its tenant's line, as it was running before any of them."""
        self._queues.setdefault(self.tenant_of(request), deque()).appendleft(request)
        self._ranks[request] = _REQUEUED

    def remove(self, request: Request) -> None:
        tenant = self.tenant_of(request)
        queue = self._queues[tenant]
        queue.remove(request)
        del self._ranks[request]
        if not queue:
            del self._queues[tenant]

    @property
    def max_per_tenant(self) -> int:
        """The most requests any one tenant has waiting."""
        return max((len(q) for q in self._queues.values()), default=0)

    @property
    def full(self) -> bool:
        """Whether all tenants' places together are taken."""
        return _at_bound(self, self.max_seqs, self.max_tokens, TENANTS_SHARE if self.fair_share else 1)

    def full_for(self, tenant: Tenant) -> bool:
        """Whether a new request of tenant's finds no place: its own are taken, or all tenants' together."""
        key = tenant if self.fair_share else ANONYMOUS_TENANT
        return self.full or _at_bound(self._queues.get(key, ()), self.max_seqs, self.max_tokens, 1)


def _at_bound(requests, max_seqs: int | None, max_tokens: int | None, share: int) -> bool:
    """Whether requests fill share times the places: in requests, or in prompt tokens still to prefill."""
    if max_seqs is not None and len(requests) >= share * max_seqs:
        return True
    if max_tokens is None or not requests:
        return False
    return sum(r.num_tokens - r.num_computed_tokens for r in requests) >= share * max_tokens
