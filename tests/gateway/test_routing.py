import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from gateway.routing.cost import (
    DISK,
    HOST,
    POOL,
    Candidate,
    TokenSources,
    prefill_tokens,
    route_request,
    token_sources,
)
from gateway.routing.index_reader import ExecutorInfo
from gateway.routing.router import Router
from shared.protocol import KVPeer
from shared.tenant import Tenant


def pool(blocks: int) -> tuple[int, ...]:
    """A leading run held in the KV pool."""
    return (POOL,) * blocks


def test_prefill_tokens_follow_the_engines_rule_that_a_hit_never_covers_the_last_token():
    # a 32-token prompt whose two blocks are both cached: the engine reuses only the first (the last token's
    # logits are needed), so it computes the whole second block, not just one token
    assert prefill_tokens(Candidate("a", "tcp://a", held=pool(2)), 32, 16) == 16
    assert prefill_tokens(Candidate("a", "tcp://a", held=pool(2)), 33, 16) == 1
    assert prefill_tokens(Candidate("a", "tcp://a", held=pool(1)), 33, 16) == 17
    assert prefill_tokens(Candidate("a", "tcp://a", held=pool(0)), 5, 16) == 5


def test_the_executor_holding_the_prefix_wins_when_loads_are_equal():
    a = Candidate("a", "tcp://a", held=pool(0))
    b = Candidate("b", "tcp://b", held=pool(60))
    assert route_request([a, b], prompt_tokens=1000, block_size=16) is b


def test_equal_caches_go_to_the_least_loaded():
    busy = Candidate("a", "tcp://a", held=pool(10), running=8, waiting=2)
    idle = Candidate("b", "tcp://b", held=pool(10))
    assert route_request([busy, idle], prompt_tokens=400, block_size=16) is idle


def test_a_small_cache_hit_does_not_outweigh_a_long_queue():
    hit_but_swamped = Candidate("a", "tcp://a", held=pool(2), running=40, waiting=30, kv_usage=0.95)
    cold_idle = Candidate("b", "tcp://b", held=pool(0))
    assert route_request([hit_but_swamped, cold_idle], prompt_tokens=100, block_size=16) is cold_idle


def test_ties_are_broken_at_random_and_no_executor_is_an_error():
    a, b = Candidate("b", "tcp://b"), Candidate("a", "tcp://a")
    rng = random.Random(0)
    picks = Counter(route_request([a, b], 50, 16, rng).executor_id for _ in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 60  # a cold burst spreads
    with pytest.raises(LookupError):
        route_request([], 50, 16)


def test_queued_prefill_counts_including_requests_still_on_their_way():
    # a holds a 200-token partial hit but is busy prefilling a cold 1,024-token prompt: b starts sooner
    busy = Candidate("a", "tcp://a", held=pool(12), prefill_tokens=1024)
    idle = Candidate("b", "tcp://b")
    assert route_request([busy, idle], 1056, 16) is idle
    # the same when that prompt was only just routed there by some gateway, not yet in a's published load
    on_its_way = Candidate("a", "tcp://a", held=pool(12), inflight_tokens=1024)
    assert route_request([on_its_way, idle], 1056, 16) is idle
    assert route_request([Candidate("a", "tcp://a", held=pool(12)), idle], 1056, 16).executor_id == "a"


def test_tokens_come_from_the_best_tier_and_a_peer_and_never_cover_the_last_token():
    held = Candidate("a", "tcp://a", held=(POOL, HOST, DISK, HOST), peer_blocks=6)
    # 100 tokens: 6 blocks may be reused (the last token is computed); 4 are held here, 2 more pulled
    assert token_sources(held, 100, 16) == TokenSources(compute=4, pool=16, host=32, disk=16, peer=32)
    # 64 tokens: only 3 blocks may be reused, so the fourth (in host memory) is computed and nothing pulled
    assert token_sources(held, 64, 16) == TokenSources(compute=16, pool=16, host=16, disk=16)
    # a peer that holds no more than the executor itself gives it nothing
    assert token_sources(Candidate("a", "tcp://a", held=pool(3), peer_blocks=2), 100, 16).peer == 0


def test_a_tier_holder_beats_computing_and_the_pool_beats_the_host_tier():
    cold = Candidate("cold", "tcp://cold")
    in_host = Candidate("host", "tcp://host", held=(HOST,) * 60)
    on_disk = Candidate("disk", "tcp://disk", held=(DISK,) * 60)
    in_pool = Candidate("pool", "tcp://pool", held=pool(60))
    assert route_request([cold, on_disk], 1000, 16) is on_disk
    assert route_request([cold, in_host, on_disk], 1000, 16) is in_host
    assert route_request([in_host, in_pool], 1000, 16) is in_pool


def test_a_pull_beats_computing_but_not_a_run_held_there():
    cold = Candidate("cold", "tcp://cold")
    pulls = Candidate("pulls", "tcp://pulls", peer_blocks=60)
    on_disk = Candidate("disk", "tcp://disk", held=(DISK,) * 60)
    assert route_request([cold, pulls], 1000, 16) is pulls
    assert route_request([pulls, on_disk], 1000, 16) is on_disk
    assert prefill_tokens(pulls, 1000, 16) == 1000 - 60 * 16  # what the in-flight count adds there


def test_a_pull_into_a_full_pool_loses_to_a_moderately_busier_holder_and_wins_into_an_empty_one():
    """Pulled KV evicts what a full pool caches: two pools that each pull every hot prefix hold half as many. An
    executor with an empty pool takes a hot prefix from its busy holder all the same."""
    holder = Candidate("holder", "tcp://holder", held=pool(62), running=3, kv_usage=0.7, kv_filled=1.0)
    full = Candidate("full", "tcp://full", peer_blocks=62, running=1, kv_usage=0.25, kv_filled=1.0)
    empty = Candidate("empty", "tcp://empty", peer_blocks=62, running=1, kv_usage=0.25, kv_filled=0.0)
    assert route_request([holder, full], 1000, 16) is holder
    assert route_request([holder, empty], 1000, 16) is empty
    swamped = Candidate("holder", "tcp://holder", held=pool(62), prefill_tokens=4000, kv_filled=1.0)
    assert route_request([swamped, full], 1000, 16) is full  # a holder far behind is still left


FINGERPRINT = "f0" * 16


def _info(executor_id: str, transfer: str = "", fingerprint: str = FINGERPRINT) -> ExecutorInfo:
    return ExecutorInfo(executor_id, f"tcp://{executor_id}:1", "tiny", 16, 4096, 0, 1, transfer, fingerprint)


class View:
    def __init__(self, view) -> None:
        self.view = view

    async def routing_view(self, hashes):
        return self.view

    async def next_round_robin(self) -> int:
        return 0


def _choose(view, policy: str = "cache_aware", ids: int = 1000):
    sent = SimpleNamespace(unanswered={}, unanswered_of_tenant={}, refused={})
    return asyncio.run(Router(View(view), policy, sent).choose(list(range(ids)), Tenant("t")))


def test_a_request_goes_to_a_free_executor_that_pulls_from_the_busy_holder():
    """The holder's queue is full: the request goes elsewhere and pulls the prefix from it, from the holder with
    the longest run among those that serve pulls of the same blocks."""
    view = [
        (_info("free"), Candidate("free", "tcp://free:1", held=pool(2))),
        (
            _info("holder", "tcp://holder:2"),
            Candidate("holder", "tcp://holder:1", held=pool(40), queue_full=True),
        ),
        (
            _info("shorter", "tcp://shorter:2"),
            Candidate("shorter", "tcp://shorter:1", held=pool(20), running=99),
        ),
        (
            _info("other", "tcp://other:2", "0e" * 16),
            Candidate("other", "tcp://other:1", held=pool(60), queue_full=True),
        ),
        (_info("unserved"), Candidate("unserved", "tcp://unserved:1", held=pool(61), queue_full=True)),
        (_info("bad", "udp://bad:2"), Candidate("bad", "tcp://bad:1", held=pool(62), queue_full=True)),
    ]
    choice = _choose(view[:2] + view[4:])
    assert choice.executor.executor_id == "free"
    assert choice.kv_peer == KVPeer("holder", "tcp://holder:2", 40)
    assert choice.sources == TokenSources(compute=1000 - 40 * 16, pool=32, peer=38 * 16)
    assert choice.prefill_estimate == 1000 - 40 * 16 and choice.reason == "prefix_hit"
    # "other" holds more, but its blocks are not interchangeable (another fingerprint); "shorter" holds less
    choice = _choose(view)
    assert choice.executor.executor_id == "free" and choice.kv_peer.executor_id == "holder"


def test_round_robin_still_pulls_what_another_holds_and_none_is_named_when_none_holds_more():
    holder = (_info("a", "tcp://a:2"), Candidate("a", "tcp://a:1", held=(HOST,) * 30))
    chosen = (_info("b", "tcp://b:2"), Candidate("b", "tcp://b:1", held=pool(10)))
    choice = _choose([chosen, holder], "round_robin")  # the view as read: round robin takes the first
    assert choice.executor.executor_id == "b" and choice.kv_peer == KVPeer("a", "tcp://a:2", 30)
    # the prompt's last token is never cached: of 30 blocks held (a 320-token prompt), 19 can be used
    choice = _choose([chosen, holder], "round_robin", ids=320)
    assert choice.kv_peer == KVPeer("a", "tcp://a:2", 19) and choice.sources.compute == 16
    assert _choose([holder, chosen], "round_robin").kv_peer is None  # a holds the longest run itself
    legacy = (_info("c", "", ""), Candidate("c", "tcp://c:1"))  # publishes no fingerprint: pulls nothing
    assert _choose([legacy, holder], "round_robin").kv_peer is None
