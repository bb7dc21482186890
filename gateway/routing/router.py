"""The routing decision for one prompt: read the live executors from Redis, apply the policy, say why.

gateway.routing.cost holds the cost model as pure functions; this module feeds it what Redis says, finds each
executor the peer it would pull the prompt's KV from, and reports the choice with what the trace and the metrics
want to know (cached blocks, where the prompt's tokens come from, cost, reason).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.api_error import APIError
from gateway.routing.adapters import Adapter, chain_salt, served_adapters
from gateway.routing.cost import (
    ROUTING_POLICIES,
    Candidate,
    TokenSources,
    route_cost,
    route_request,
    token_sources,
)
from gateway.routing.index_reader import ExecutorInfo, IndexReader
from shared.block_hash import hash_blocks, max_cached_blocks
from shared.defaults import DEFAULT_BLOCK_SIZE
from shared.protocol import KVPeer, is_peer_address
from shared.tenant import Tenant

log = logging.getLogger("kvserve.gateway.router")


@dataclass(slots=True, frozen=True)
class Choice:
    executor: ExecutorInfo
    block_hashes: list[bytes]
    prefill_estimate: int  # prompt tokens the executor has to prefill, by its cached blocks
    cached_blocks: int
    cost: float  # the cache_aware cost of this executor, whatever the policy
    reason: str  # prefix_hit | least_loaded | round_robin | random | retry
    held_s: float = (
        0.0  # how long the request waited at the gateway (gateway.routing.backlog) for this choice
    )
    kv_peer: KVPeer | None = None  # the executor to pull the prompt's blocks from that this one lacks
    sources: TokenSources = TokenSources()  # where the prompt's tokens come from there, for the trace
    adapter: Adapter | None = None  # the LoRA adapter it runs under, as the executors serve it now


@dataclass(slots=True, frozen=True)
class Catalog:
    """What the live executors serve, read once for a request before its body: the longest context one of them
    takes (0: none lives) and the LoRA adapters, by name."""

    max_model_len: int
    adapters: dict[str, Adapter]


class Saturated(Exception):
    """Every live executor's waiting queue is at its bound: the request waits at the gateway (gateway.routing.backlog)."""


NO_EXECUTOR_MESSAGE = "no executor is available; try again shortly"


def _index_unreachable(error: Exception) -> APIError:
    log.error("redis unreachable: %s", error)
    return APIError(503, "the executor index (Redis) is unreachable", "server_error")


class SentRequests(Protocol):
    """What this gateway knows of the executors it sends to beyond what they publish (ExecutorClient is one)."""

    # executor address -> requests this gateway sent there that have had no answer yet
    unanswered: Mapping[str, int]
    unanswered_of_tenant: Mapping[tuple[str, Tenant], int]  # the same per (executor address, tenant)
    refused: Mapping[str, str]  # executor address -> why it refused this gateway's connection


class Router:
    def __init__(self, index: IndexReader, policy: str, sent: SentRequests) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy: {policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        self.index = index
        self.policy = policy
        self.sent = sent
        # whether the executors last seen keep waiting places per tenant (fair share on): the backlog then keeps
        # a line per tenant too, else one line for all, first come first served
        self.places_per_tenant = True

    async def catalog(self) -> Catalog:
        """From the live executors' registrations alone: a model no key may use is refused before the body is
        parsed, and a prompt too long for every executor before its routing read sends Redis one hash per block
        (megabytes for the longest prompts a body may hold)."""
        try:
            executors = await self.index.live_executors()
        except Exception as error:
            raise _index_unreachable(error) from None
        return Catalog(
            max((info.max_model_len for info in executors), default=0),
            served_adapters(info.lora_adapters for info in executors),
        )

    async def choose(
        self,
        ids: Sequence[int],
        tenant: Tenant,
        exclude: set[str] = frozenset(),
        avoid: set[str] = frozenset(),
        adapter: Adapter | None = None,
    ) -> Choice:
        """The executor for a prompt under the policy, among those with room in their queue for the tenant's
        request; executors in exclude (tried and lost) are skipped, and so are those in avoid (they just refused
        it as busy). Under a LoRA adapter, only executors serving it (the same files) are candidates. Raises
        Saturated when live executors exist but none has room."""
        block_size = DEFAULT_BLOCK_SIZE  # a guess, checked against what the executors report
        hashes = hash_blocks(ids, block_size, chain_salt(tenant, adapter))
        view = await self._view(hashes, exclude)
        current = _served_now(view, adapter)
        servers = _serving(view, current)
        # executors with other blocks, or the adapter's files changed since admission: hash again, read again
        if servers[0][0].block_size != block_size or current != adapter:
            block_size, adapter = servers[0][0].block_size, current
            hashes = hash_blocks(ids, block_size, chain_salt(tenant, adapter))
            view = await self._view(hashes, exclude)
            servers = _serving(view, adapter)
            if not servers:
                raise _not_served(adapter)
        view = [(info, load) for info, load in view if info.block_size == block_size]
        self.places_per_tenant = any(info.waiting_tenants_share > 1 for info, _ in view)
        # any live executor may send blocks, a busy one too: that is the point of a pull
        holders = view
        view = [
            (info, load)
            for info, load in _serving(view, adapter)
            if self._has_room(info, load, avoid, tenant)
        ]
        if not view:
            raise Saturated
        usable = max_cached_blocks(len(ids), block_size)
        peers = {info.executor_id: best_peer(info, load, holders, usable) for info, load in view}
        for info, load in view:  # the cost counts what each would pull
            peer = peers[info.executor_id]
            load.peer_blocks = peer.num_blocks if peer is not None else 0
        if self.policy == "round_robin":
            info, load = view[await self.index.next_round_robin() % len(view)]
        elif self.policy == "random":
            info, load = random.choice(view)
        else:
            name = adapter.name if adapter is not None else None
            load = route_request([load for _, load in view], len(ids), block_size, adapter=name)
            info = next(info for info, _ in view if info.executor_id == load.executor_id)
        if exclude:
            reason = "retry"
        elif self.policy != "cache_aware":
            reason = self.policy
        else:
            reason = "prefix_hit" if load.cached_blocks or load.peer_blocks else "least_loaded"
        sources = token_sources(load, len(ids), block_size)
        kv_peer = peers[info.executor_id]
        if kv_peer is not None:
            log.debug("routed to %s, pulling from %s: %s", info.executor_id, kv_peer.executor_id, sources)
        return Choice(
            info,
            hashes,
            sources.compute,
            load.cached_blocks,
            route_cost(load, len(ids), block_size, adapter.name if adapter is not None else None),
            reason,
            kv_peer=kv_peer,
            sources=sources,
            adapter=adapter,
        )

    def _has_room(self, info: ExecutorInfo, load: Candidate, avoid: set[str], tenant: Tenant) -> bool:
        """Not at its queue bound for this tenant nor for all, by what it published or by what this gateway
        sent it since: a burst (or the backlog emptying) must not send all at once to the executor that looked
        free. The tenant's own places are counted by what this gateway sent (the executor publishes only the
        total): another gateway's requests of the same tenant make it refuse as busy, and the request waits."""
        if load.queue_full or info.executor_id in avoid:
            return False
        if not info.max_waiting_seqs:
            return True
        everyone = max(load.waiting - load.compiling, self.sent.unanswered.get(info.address, 0))
        if everyone >= info.max_waiting_seqs * info.waiting_tenants_share:
            return False
        return self.sent.unanswered_of_tenant.get((info.address, tenant), 0) < info.max_waiting_seqs

    async def _view(self, hashes: list[bytes], exclude: set[str]) -> list[tuple[ExecutorInfo, Candidate]]:
        try:
            view = await self.index.routing_view(hashes)
        except Exception as error:
            raise _index_unreachable(error) from None
        view = [(info, load) for info, load in view if info.executor_id not in exclude]
        reachable = [(info, load) for info, load in view if info.address not in self.sent.refused]
        if view and not reachable:  # the client has logged why, once
            raise APIError(
                503, "no executor accepts this gateway's connection (see the gateway's log)", "server_error"
            )
        if not reachable:
            raise APIError(503, NO_EXECUTOR_MESSAGE, "server_error")
        return reachable


def _served_now(view: Sequence[tuple[ExecutorInfo, Candidate]], adapter: Adapter | None) -> Adapter | None:
    """The adapter as the live executors serve it now (its files may have changed since the request's admission)."""
    if adapter is None:
        return None
    current = served_adapters(info.lora_adapters for info, _ in view).get(adapter.name)
    if current is None:
        raise _not_served(adapter)
    return current


def _serving(
    view: Sequence[tuple[ExecutorInfo, Candidate]], adapter: Adapter | None
) -> list[tuple[ExecutorInfo, Candidate]]:
    """The executors that can run a request under the adapter: every one for the base model."""
    if adapter is None:
        return list(view)
    return [(info, load) for info, load in view if info.lora_adapters.get(adapter.name) == adapter.digest]


def _not_served(adapter: Adapter) -> APIError:
    """Its executors stopped serving it after the request was admitted (unloaded, or they were lost)."""
    return APIError(
        503, f"no live executor serves the adapter {adapter.name!r} now; try again shortly", "server_error"
    )


def best_peer(
    info: ExecutorInfo, load: Candidate, view: Sequence[tuple[ExecutorInfo, Candidate]], usable: int
) -> KVPeer | None:
    """The other live executor this one would pull the prompt's blocks from, with the leading blocks it holds (at
    most usable: the engine's cached prefix never covers the last token): the one holding the longest run past this
    one's own, among those that serve pulls (a kv_transfer_address) of interchangeable blocks (the same
    kv_fingerprint); the first by id of equals. None when none holds more. A peer publishing an address the
    executor would refuse is passed over: the request would be refused with it."""
    if not info.kv_fingerprint:  # an executor that publishes none cannot check what it would be sent
        return None
    best, best_run = None, min(load.cached_blocks, usable)
    for peer, peer_load in view:
        if peer.executor_id == info.executor_id or not is_peer_address(peer.kv_transfer_address):
            continue
        run = min(peer_load.cached_blocks, usable)
        if peer.kv_fingerprint == info.kv_fingerprint and run > best_run:
            best, best_run = peer, run
    return KVPeer(best.executor_id, best.kv_transfer_address, best_run) if best is not None else None
