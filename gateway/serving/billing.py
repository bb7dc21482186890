"""What an ended request used, settled against its caller's tenant: tokens and KV block-seconds counted, its
reservation given back for what it really took, and the KV block-seconds an executor reports only after the
request was aborted billed when they come. Billing never fails a request: a tenant's limits heal what it misses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from gateway.routing.dispatch import Dispatch
from gateway.routing.executor_client import ExecutorClient
from gateway.routing.in_flight import InFlight
from gateway.telemetry.metrics import GatewayMetrics
from gateway.tenants.tenancy import Caller, Tenancy

log = logging.getLogger("kvserve.gateway")


def usage_of(flight: InFlight) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens: a request that failed without streaming gave the client no output."""
    generation = flight.delivered.generations[0]
    completion_tokens = sum(g.output.num_tokens for g in flight.delivered.generations)
    if flight.error is not None and not flight.stream:  # it failed: the client was given none of them
        completion_tokens = 0
    return generation.num_prompt_tokens, completion_tokens, generation.cached_tokens


class Billing:
    def __init__(
        self, tenancy: Tenancy, metrics: GatewayMetrics, client: ExecutorClient, dispatch: Dispatch
    ) -> None:
        self.tenancy = tenancy
        self.metrics = metrics
        self.client = client
        self.dispatch = dispatch

    async def settle(self, flight: InFlight, usage: tuple[int, int, int]) -> None:
        """Once the executor has been released: what its executor still owes is billed in the background."""
        tenant = flight.caller.tenant.name
        adapter = flight.request.lora  # None: the base model
        self.metrics.count_usage(tenant, adapter or "", usage[0], usage[2], flight.delivered.kv_block_seconds)
        try:
            await self.tenancy.release(
                flight.caller,
                flight.request.request_id,
                flight.reserved_tokens,
                *usage,
                kv_block_seconds=flight.delivered.kv_block_seconds,
                cached_from=flight.delivered.generations[0].cached_from,  # as usage_of's cached tokens
                adapter=adapter,
            )
        except Exception as error:  # the slot's lease and the bucket's refill heal what this misses
            log.error("settling tenant %s's limits failed: %s", tenant, error)
        owed = self.client.owed_kv_block_seconds(flight.request.request_id)
        if owed is not None:  # aborted before its last update: its executor says what its KV held later
            self.dispatch.in_background(self._bill_owed(flight.caller, flight.request.request_id, owed))

    async def _bill_owed(self, caller: Caller, request_id: str, owed: Awaitable[float | None]) -> None:
        kv_block_seconds = await owed
        if not kv_block_seconds:
            return
        self.metrics.kv_block_seconds.labels(caller.tenant.name).inc(kv_block_seconds)
        try:
            await self.tenancy.count_kv_block_seconds(caller, request_id, kv_block_seconds)
        except Exception as error:  # as in settle: billing must not fail a request, and this one has ended
            log.error("counting tenant %s's KV block-seconds failed: %s", caller.tenant.name, error)
