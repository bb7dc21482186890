"""Which executor serves a request: the one with the least work ahead of it.

Cost (route_cost), in prefill-equivalent tokens of work ahead of the request's first token: its own prompt tokens
the executor would compute, plus those whose KV it would load from a tier of its own or pull from a peer, each at
a fraction of a computed token; the prompt tokens queued there (published, plus those on their way), the running
requests' decodes, a penalty as the KV pool fills (a full pool means preemptions), and under a LoRA adapter what
bringing the adapter into a step costs there (adapter_cost). Equal costs are broken at random, so a burst of cold
requests spreads instead of all taking the first executor.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.block_hash import max_cached_blocks

# cache_aware routes by this module's cost; the other two are there to compare it with (gateway/routing/router.py)
ROUTING_POLICIES = ("cache_aware", "round_robin", "random")

# one running request delays a new one about as much as this many prompt tokens of prefill
TOKENS_PER_RUNNING_REQUEST = 64
# at a full KV pool, an executor looks this many tokens more expensive
TOKENS_AT_FULL_KV = 2048

# where an executor holds a block, best first: the codes of the routing view (gateway/routing/index_reader.py)
POOL, HOST, DISK = 1, 2, 3
# What one token's KV costs brought in rather than computed, as a share of computing it. From host memory it is a
# memcpy (over PCIe into a GPU's pool), ~1-2% of the token's forward pass; from disk a file read and its checksum
# besides, ~5-10%; from a peer its read there and the network between, ~10-20%. Each is the top of its range: a
# load that saves little keeps the simpler path, and one that fails (a file gone, a peer busy) is computed after
# all. The order is what matters most: pool < host < disk < peer < computing.
HOST_LOAD_COST = 0.02
DISK_LOAD_COST = 0.1
PEER_PULL_COST = 0.2
# A prompt's KV brought into a pool full of other prompts' evicts theirs: tokens someone may need again, at a
# computed token each if they are. Without it a pull is so cheap that a busy holder's load sends a prefix to a
# peer, which then holds it too: two pools each holding every hot prefix hold half as many, and the routing
# benchmark's cache-aware share fell from 88% to 53%. Charged by how full the pool is (kv_filled), so an empty
# executor still takes a hot prefix from its busy holder.
DISPLACEMENT = 1.0
_LOAD_COST = {POOL: 0.0, HOST: HOST_LOAD_COST, DISK: DISK_LOAD_COST}
# A request under a LoRA adapter, by where the executor has it: used by its running requests (in a step's slots),
# nothing more; held in host memory, a copy into the step's tensors, about a short prompt's prefill; only on disk, a
# read of its files and their digest on a worker thread while its requests wait, about a few running requests'
# decodes. These are bounded on purpose: once the executor running an adapter has more work queued than loading it
# elsewhere costs, its next requests go to another executor, which loads it too (the spreading llm-d's LoRA
# affinity scorer does once an adapter's servers are saturated).
ADAPTER_HOST_LOAD_TOKENS = 32
ADAPTER_DISK_LOAD_TOKENS = 256
# An executor whose every step slot (max_loras) other adapters' running requests hold: the request waits until one
# of those adapters' requests all end, about a whole decode.
ADAPTER_SLOT_WAIT_TOKENS = 1024


@dataclass(slots=True)
class Candidate:
    executor_id: str
    address: str
    # the best place (POOL, HOST, DISK) it holds each of the prompt's leading blocks, up to the first held nowhere
    held: tuple[int, ...] = ()
    running: int = 0
    waiting: int = 0
    compiling: int = 0  # of waiting, those waiting for their grammar: they hold no place in its queue
    kv_usage: float = 0.0  # share of its KV blocks in use, 0..1
    # share of its KV blocks holding KV, in use or cached (0 from an executor that does not say): a block brought
    # into its pool (computed, loaded or pulled) evicts one of these with about this chance
    kv_filled: float = 0.0
    prefill_tokens: int = 0  # prompt tokens queued there, still to prefill
    inflight_tokens: int = 0  # prompt tokens to prefill of requests routed there, not yet in its load
    queue_full: bool = False  # its waiting queue is at its bound: it refuses new requests as busy
    # leading blocks another executor holds and would send it (the router's best peer for it; 0: none holds more)
    peer_blocks: int = 0
    # LoRA adapters, by name: those its running requests use, those its host memory holds; and how many distinct
    # adapters one of its steps runs (0: it does not say)
    lora_running: frozenset[str] = field(default_factory=frozenset)
    lora_held: frozenset[str] = field(default_factory=frozenset)
    max_loras: int = 0

    @property
    def cached_blocks(self) -> int:
        """The leading run it holds anywhere: all of it counts as cached once loaded."""
        return len(self.held)


@dataclass(frozen=True, slots=True)
class TokenSources:
    """Where a prompt's tokens would come from on one executor: computed, or their KV found in its pool, loaded
    from its host or disk tier, or pulled from a peer."""

    compute: int = 0
    pool: int = 0
    host: int = 0
    disk: int = 0
    peer: int = 0

    def by_source(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def brought_in(self) -> int:
        """Tokens whose KV would take blocks of the pool that it does not hold yet."""
        return self.compute + self.host + self.disk + self.peer

    def work(self) -> float:
        """In computed-token equivalents."""
        return (
            self.compute
            + self.host * HOST_LOAD_COST
            + self.disk * DISK_LOAD_COST
            + self.peer * PEER_PULL_COST
        )


def token_sources(candidate: Candidate, prompt_tokens: int, block_size: int) -> TokenSources:
    """Where the executor would find each prompt token, by the engine's rule that no cached prefix (wherever its KV
    comes from) covers the last prompt token: its logits are needed."""
    usable = max_cached_blocks(prompt_tokens, block_size)
    own = candidate.held[:usable]
    pulled = max(0, min(candidate.peer_blocks, usable) - len(own))
    return TokenSources(
        compute=prompt_tokens - (len(own) + pulled) * block_size,
        pool=own.count(POOL) * block_size,
        host=own.count(HOST) * block_size,
        disk=own.count(DISK) * block_size,
        peer=pulled * block_size,
    )


def prefill_tokens(candidate: Candidate, prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens this executor would compute: what its cached leading blocks (and a peer's) leave."""
    return token_sources(candidate, prompt_tokens, block_size).compute


def adapter_cost(candidate: Candidate, adapter: str | None) -> float:
    """What running the request under the adapter (None: the base model) costs there before its prompt's work."""
    if adapter is None or adapter in candidate.lora_running:
        return 0.0
    slots_taken = candidate.max_loras and len(candidate.lora_running) >= candidate.max_loras
    load = ADAPTER_HOST_LOAD_TOKENS if adapter in candidate.lora_held else ADAPTER_DISK_LOAD_TOKENS
    return load + (ADAPTER_SLOT_WAIT_TOKENS if slots_taken else 0)


def route_cost(
    candidate: Candidate, prompt_tokens: int, block_size: int, adapter: str | None = None
) -> float:
    queued = candidate.prefill_tokens + candidate.inflight_tokens
    decodes = TOKENS_PER_RUNNING_REQUEST * candidate.running
    sources = token_sources(candidate, prompt_tokens, block_size)
    return (
        sources.work()
        + DISPLACEMENT * candidate.kv_filled * sources.brought_in()
        + queued
        + decodes
        + TOKENS_AT_FULL_KV * candidate.kv_usage**2
        + adapter_cost(candidate, adapter)
    )


def route_request(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    block_size: int,
    rng: random.Random = random,
    adapter: str | None = None,
) -> Candidate:
    """The cheapest live executor, one of the cheapest at random when several cost the same."""
    if not candidates:
        raise LookupError("no live executor")
    costs = [route_cost(c, prompt_tokens, block_size, adapter) for c in candidates]
    cheapest = min(costs)
    return rng.choice([c for c, cost in zip(candidates, costs, strict=True) if cost == cheapest])
