"""Which executor serves a request: the one with the least work ahead of it.

Cost = prompt tokens it would still have to prefill (its cached leading run of the prompt's blocks is free)
+ a load term: the requests already on it or on their way to it, each counted as the prefill-equivalent tokens
of work it represents, and a penalty as its KV pool fills (a full pool means preemptions). Equal costs are
broken at random, so a burst of cold requests spreads instead of all taking the first executor.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

# one running or waiting request delays a new one about as much as this many prompt tokens of prefill
TOKENS_PER_QUEUED_REQUEST = 64
# at a full KV pool, an executor looks this many tokens more expensive
TOKENS_AT_FULL_KV = 2048


@dataclass(slots=True)
class Candidate:
    executor_id: str
    address: str
    cached_blocks: int  # leading run of the prompt's block hashes this executor holds
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # share of its KV blocks in use, 0..1
    inflight: int = 0  # routed there by some gateway, not yet in its published load


def leading_run(held: Sequence[bool]) -> int:
    """How many of the prompt's blocks, from the first, an executor holds: a prefix hit stops at a gap."""
    for i, present in enumerate(held):
        if not present:
            return i
    return len(held)


def route_cost(candidate: Candidate, prompt_tokens: int, block_size: int) -> float:
    # a hit never covers the last prompt token, as in the engine
    hit_tokens = min(candidate.cached_blocks * block_size, prompt_tokens - 1)
    load = TOKENS_PER_QUEUED_REQUEST * (candidate.running + candidate.waiting + candidate.inflight)
    return (prompt_tokens - hit_tokens) + load + TOKENS_AT_FULL_KV * candidate.kv_usage**2


def route_request(
    candidates: Sequence[Candidate], prompt_tokens: int, block_size: int, rng: random.Random = random
) -> Candidate:
    """The cheapest live executor, one of the cheapest at random when several cost the same."""
    if not candidates:
        raise LookupError("no live executor")
    costs = [route_cost(c, prompt_tokens, block_size) for c in candidates]
    cheapest = min(costs)
    return rng.choice([c for c, cost in zip(candidates, costs, strict=True) if cost == cheapest])
