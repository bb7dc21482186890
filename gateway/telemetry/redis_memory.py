"""Redis's memory and the stored responses' bytes, as every scrape of a gateway shows them.

Redis holds the whole stack's shared state (API keys, the executors' indexes, limits, stored responses) up to the
maxmemory its deployment sets, and refuses writes past it (noeviction: compose.yaml, deploy/kubernetes/), so the
dashboard shows how near it is, and how much of it the stored responses take against their bound
(--responses-max-total-bytes). Read fresh at every scrape, as the executors' series are; each gateway shows the same
values (the dashboard takes one); left out while Redis does not answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client.core import GaugeMetricFamily

from gateway.response_store import ResponseStore


@dataclass(slots=True, frozen=True)
class RedisMemory:
    used_bytes: int  # INFO memory's used_memory
    max_bytes: int  # its maxmemory; 0: unbounded
    stored_responses_bytes: int
    max_stored_responses_bytes: int


async def read_redis_memory(client: aioredis.Redis, store: ResponseStore) -> RedisMemory:
    info = await client.info("memory")
    return RedisMemory(
        int(info["used_memory"]),
        int(info.get("maxmemory", 0)),
        await store.stored_bytes(),
        store.limits.max_total_bytes,
    )


_GAUGES = {
    "used_bytes": ("kvserve_redis_memory_used_bytes", "Bytes Redis holds (INFO memory: used_memory)."),
    "max_bytes": (
        "kvserve_redis_memory_max_bytes",
        "Redis's maxmemory: past it, writes are refused (0: no bound set).",
    ),
    "stored_responses_bytes": (
        "kvserve_responses_stored_bytes",
        "Bytes of stored responses (/v1/responses), all tenants together.",
    ),
    "max_stored_responses_bytes": (
        "kvserve_responses_max_total_bytes",
        "The bound on all tenants' stored responses (--responses-max-total-bytes): past it, stores are refused.",
    ),
}


class RedisMemoryCollector:
    """Its families always (with no sample while snapshot is None), so a scrape names them even when Redis is down."""

    def __init__(self) -> None:
        self.snapshot: RedisMemory | None = None

    def collect(self):
        for field, (name, text) in _GAUGES.items():
            family = GaugeMetricFamily(name, text)
            if self.snapshot is not None:
                family.add_metric([], getattr(self.snapshot, field))
            yield family
