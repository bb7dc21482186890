"""Which executor serves a request: the one with the least work ahead of it.

Cost (route_cost), in prefill-equivalent tokens of work ahead of the request's first token: its own prompt
tokens past the executor's cached prefix, the prompt tokens queued there (published, plus those on their way),
the running requests' decodes, and a penalty as the KV pool fills (a full pool means preemptions). Equal costs
are broken at random, so a burst of cold requests spreads instead of all taking the first executor.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shared.block_hash import max_cached_blocks

# cache_aware routes by this module's cost; the other two are there to compare it with (gateway/routing/router.py)
ROUTING_POLICIES = ("cache_aware", "round_robin", "random")

# one running request delays a new one about as much as this many prompt tokens of prefill
TOKENS_PER_RUNNING_REQUEST = 64
# at a full KV pool, an executor looks this many tokens more expensive
TOKENS_AT_FULL_KV = 2048


@dataclass(slots=True)
class Candidate:
    executor_id: str
    address: str
    cached_blocks: int  # leading run of the prompt's block hashes this executor holds
    running: int = 0
    waiting: int = 0
    compiling: int = 0  # of waiting, those waiting for their grammar: they hold no place in its queue
    kv_usage: float = 0.0  # share of its KV blocks in use, 0..1
    prefill_tokens: int = 0  # prompt tokens queued there, still to prefill
    inflight_tokens: int = 0  # prompt tokens to prefill of requests routed there, not yet in its load
    queue_full: bool = False  # its waiting queue is at its bound: it refuses new requests as busy


def leading_run(held: Sequence[bool]) -> int:
    """How many of the prompt's blocks, from the first, an executor holds: a prefix hit stops at a gap."""
    for i, present in enumerate(held):
        if not present:
            return i
    return len(held)


def prefill_tokens(candidate: Candidate, prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens this executor would compute: what its cached leading blocks leave, by the engine's rule."""
    return (
        prompt_tokens
        - min(candidate.cached_blocks, max_cached_blocks(prompt_tokens, block_size)) * block_size
    )


def route_cost(candidate: Candidate, prompt_tokens: int, block_size: int) -> float:
    queued = candidate.prefill_tokens + candidate.inflight_tokens
    decodes = TOKENS_PER_RUNNING_REQUEST * candidate.running
    own = prefill_tokens(candidate, prompt_tokens, block_size)
    return own + queued + decodes + TOKENS_AT_FULL_KV * candidate.kv_usage**2


def route_request(
    candidates: Sequence[Candidate], prompt_tokens: int, block_size: int, rng: random.Random = random
) -> Candidate:
    """The cheapest live executor, one of the cheapest at random when several cost the same."""
    if not candidates:
        raise LookupError("no live executor")
    costs = [route_cost(c, prompt_tokens, block_size) for c in candidates]
    cheapest = min(costs)
    return rng.choice([c for c, cost in zip(candidates, costs, strict=True) if cost == cheapest])
