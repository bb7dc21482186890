"""Whose request it is, one value from the gateway's admission to the executor's scheduler and block pool.

The gateway builds it from the caller's API key (gateway/tenants/tenancy.py), or takes ANONYMOUS_TENANT for a
gateway serving without keys; the generate message carries it (shared/protocol.py); the executor's Request holds
it, and its scheduler, fair share, waiting queue, grammar turns and block pool tell tenants apart by it.

A request's priority is not here: it is the request's own (its body's `priority`), and a tenant's requests differ
in it, while everything here is the same for every request a key sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TENANT_WEIGHT = 1000.0  # a tenant's weight is in (0, this]


@dataclass(frozen=True, slots=True)
class Tenant:
    """Told apart by name and salt, so a key's tenant that happens to be named "anonymous" is not the anonymous
    tenant. The weight is not part of who it is: a tenant's keys may carry different weights, and their requests
    are one tenant's all the same (one fair-share counter, one set of waiting places, one KV share)."""

    name: str
    # the tenant's secret: its block hashes start from it (shared/block_hash.py), so tenants never share, or probe,
    # each other's prefix cache; None for the anonymous tenant
    cache_salt: str | None = None
    # its share of each engine step and of the KV cache relative to other tenants' (its key's --weight)
    weight: float = field(default=1.0, compare=False)


# the tenant of every request to a gateway serving without keys: no salt, the default weight
ANONYMOUS_TENANT = Tenant("anonymous")
