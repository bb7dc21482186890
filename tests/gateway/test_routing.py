import random
from collections import Counter

import pytest

from gateway.routing.cost import Candidate, leading_run, prefill_tokens, route_request


def test_leading_run_stops_at_the_first_gap():
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([False, True]) == 0
    assert leading_run([True] * 3) == 3 and leading_run([]) == 0


def test_prefill_tokens_follow_the_engines_rule_that_a_hit_never_covers_the_last_token():
    # a 32-token prompt whose two blocks are both cached: the engine reuses only the first (the last token's
    # logits are needed), so it computes the whole second block, not just one token
    assert prefill_tokens(Candidate("a", "tcp://a", cached_blocks=2), 32, 16) == 16
    assert prefill_tokens(Candidate("a", "tcp://a", cached_blocks=2), 33, 16) == 1
    assert prefill_tokens(Candidate("a", "tcp://a", cached_blocks=1), 33, 16) == 17
    assert prefill_tokens(Candidate("a", "tcp://a", cached_blocks=0), 5, 16) == 5


def test_the_executor_holding_the_prefix_wins_when_loads_are_equal():
    a = Candidate("a", "tcp://a", cached_blocks=0)
    b = Candidate("b", "tcp://b", cached_blocks=60)
    assert route_request([a, b], prompt_tokens=1000, block_size=16) is b


def test_equal_caches_go_to_the_least_loaded():
    busy = Candidate("a", "tcp://a", cached_blocks=10, running=8, waiting=2)
    idle = Candidate("b", "tcp://b", cached_blocks=10)
    assert route_request([busy, idle], prompt_tokens=400, block_size=16) is idle


def test_a_small_cache_hit_does_not_outweigh_a_long_queue():
    hit_but_swamped = Candidate("a", "tcp://a", cached_blocks=2, running=40, waiting=30, kv_usage=0.95)
    cold_idle = Candidate("b", "tcp://b", cached_blocks=0)
    assert route_request([hit_but_swamped, cold_idle], prompt_tokens=100, block_size=16) is cold_idle


def test_ties_are_broken_at_random_and_no_executor_is_an_error():
    a, b = Candidate("b", "tcp://b", 0), Candidate("a", "tcp://a", 0)
    rng = random.Random(0)
    picks = Counter(route_request([a, b], 50, 16, rng).executor_id for _ in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 60  # a cold burst spreads
    with pytest.raises(LookupError):
        route_request([], 50, 16)


def test_queued_prefill_counts_including_requests_still_on_their_way():
    # a holds a 200-token partial hit but is busy prefilling a cold 1,024-token prompt: b starts sooner
    busy = Candidate("a", "tcp://a", cached_blocks=12, prefill_tokens=1024)
    idle = Candidate("b", "tcp://b", 0)
    assert route_request([busy, idle], 1056, 16) is idle
    # the same when that prompt was only just routed there by some gateway, not yet in a's published load
    on_its_way = Candidate("a", "tcp://a", cached_blocks=12, inflight_tokens=1024)
    assert route_request([on_its_way, idle], 1056, 16) is idle
    assert route_request([Candidate("a", "tcp://a", cached_blocks=12), idle], 1056, 16).executor_id == "a"
