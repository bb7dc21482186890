"""How much of the engine each tenant has had: a Virtual Token Counter ("Fairness in Serving Large Language
Models", Sheng et al., OSDI 2024).

Each tenant with work has a counter of the service it received, in tokens divided by its weight; the scheduler
hands the next prefill chunk to the tenant whose counter is lowest (executor/scheduling/scheduler.py), so tenants
that are all backlogged get tokens in proportion to their weights, and a burst waits behind itself. A tenant that
had no work is lifted, when work arrives, to the lowest counter among tenants that have some: time spent idle
banks no credit to spend later in a burst of its own, and a tenant cannot escape a debt by going idle for a
moment.
"""

from __future__ import annotations

from collections import OrderedDict

from shared.tenant import Tenant

# A prompt token found in the prefix cache costs no forward pass, but it holds a KV slot while its request runs and
# is attended to at every step after; at no cost a tenant could replay long cached prompts without limit. A tenth
# of a computed token: cheap enough that sending a shared prefix pays, dear enough that a flood of them counts.
CACHED_TOKEN_COST = 0.1
REMEMBERED_IDLE_TENANTS = (
    1024  # counters kept of tenants with no work; past that the longest idle is forgotten
)


class VirtualTokenCounter:
    """Service received per tenant (the anonymous one a tenant like any other), in weighted tokens."""

    def __init__(self, remembered: int = REMEMBERED_IDLE_TENANTS) -> None:
        self._active: dict[Tenant, float] = {}  # tenants with work: their counters
        self._num_requests: dict[Tenant, int] = {}  # of each tenant with work: its requests
        # counters of tenants without work, longest idle first; a forgotten one is lifted as a new tenant is
        self._idle: OrderedDict[Tenant, float] = OrderedDict()
        self._last_left = 0.0  # the counter of the last tenant to leave while none had work: the floor then
        self.remembered = remembered

    def __contains__(self, tenant: Tenant) -> bool:
        """Whether the tenant has work."""
        return tenant in self._active

    def of(self, tenant: Tenant) -> float:
        """A tenant's counter; one with no work, remembered or not, reads as it would be lifted on arrival."""
        if tenant in self._active:
            return self._active[tenant]
        return max(self._idle.get(tenant, 0.0), self._floor())

    def join(self, tenant: Tenant) -> None:
        """A request of tenant's arrived; the first of a tenant without work lifts its counter to the floor."""
        if tenant not in self._active:
            self._active[tenant] = max(self._idle.pop(tenant, 0.0), self._floor())
            self._num_requests[tenant] = 0
        self._num_requests[tenant] += 1

    def leave(self, tenant: Tenant) -> None:
        """A request of tenant's finished; its last leaving makes the tenant idle."""
        self._num_requests[tenant] -= 1
        if self._num_requests[tenant]:
            return
        del self._num_requests[tenant]
        counter = self._active.pop(tenant)
        if not self._active:
            self._last_left = counter
        self._idle[tenant] = counter
        if len(self._idle) > self.remembered:
            self._idle.popitem(last=False)

    def charge(self, tenant: Tenant, weight: float, tokens: float) -> None:
        """Count tokens of service (negative: give back service charged but not given) at the tenant's weight."""
        self._active[tenant] += tokens / weight

    def _floor(self) -> float:
        """Where an arriving tenant starts at the least: VTC's lift, the lowest counter of the tenants with work,
        or, when none has any, the counter of the last one that had."""
        return min(self._active.values()) if self._active else self._last_left


def service(computed: int, cached: int = 0) -> float:
    """Tokens of service a scheduled chunk gives: each computed token (prompt, decoded or a proposal to verify)
    counts one, each prompt token taken from the prefix cache CACHED_TOKEN_COST."""
    return computed + CACHED_TOKEN_COST * cached
