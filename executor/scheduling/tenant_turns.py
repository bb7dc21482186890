"""Whose turn it is: work queued by tenant and served one item at a time, the tenant served least recently going
next (one never served before any other), first come first served within a tenant. So a tenant's burst waits
behind itself, never in front of another tenant's single item."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

from shared.tenant import Tenant

T = TypeVar("T")

REMEMBERED_TENANTS = 1024  # tenants whose last turn is kept


class TenantTurns(Generic[T]):
    """A fair queue over tenants (the anonymous one a tenant like any other)."""

    def __init__(self, remembered: int = REMEMBERED_TENANTS) -> None:
        self._queued: dict[Tenant, deque[T]] = {}  # tenants with work, in the order their work arrived
        # each tenant's last turn, least recent first; past `remembered` tenants the oldest are forgotten (memory
        # stays bounded; a forgotten tenant ranks as one never served, so the order is exact up to that many)
        self._served: OrderedDict[Tenant, int] = OrderedDict()
        self._turns = 0
        self._size = 0
        self.remembered = remembered

    def __len__(self) -> int:
        return self._size

    def push(self, tenant: Tenant, item: T) -> None:
        self._queued.setdefault(tenant, deque()).append(item)
        self._size += 1

    def pop(self) -> T:
        """The next item: the oldest of the tenant whose last turn is oldest. IndexError when there is none."""
        if not self._queued:
            raise IndexError("pop from an empty TenantTurns")
        tenant = min(
            self._queued, key=lambda t: self._served.get(t, -1)
        )  # ties: the tenant that queued first
        queue = self._queued[tenant]
        item = queue.popleft()
        if not queue:
            del self._queued[tenant]
        self._size -= 1
        self._turns += 1
        self._served[tenant] = self._turns
        self._served.move_to_end(tenant)
        while len(self._served) > self.remembered:
            self._served.popitem(last=False)
        return item

    def remove(self, tenant: Tenant, item: T) -> bool:
        """Take back an item still queued; whether it was."""
        queue = self._queued.get(tenant)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queued[tenant]
        self._size -= 1
        return True

    def clear(self) -> list[T]:
        """Every item still queued, the queue left empty."""
        items = [item for queue in self._queued.values() for item in queue]
        self._queued.clear()
        self._size = 0
        return items
