import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from gateway.api_error import APIError
from gateway.routing.adapters import Adapter, served_adapters
from gateway.routing.cost import (
    ADAPTER_DISK_LOAD_TOKENS,
    DISK,
    HOST,
    POOL,
    TOKENS_PER_RUNNING_REQUEST,
    Candidate,
    TokenSources,
    prefill_tokens,
    route_cost,
    route_request,
    token_sources,
)
from gateway.routing.index_reader import ExecutorInfo
from gateway.routing.router import Router
from shared.block_hash import adapter_salt, hash_blocks
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


def _choose(view, policy: str = "cache_aware", ids: int = 1000, adapter: Adapter | None = None):
    sent = SimpleNamespace(unanswered={}, unanswered_of_tenant={}, refused={})
    router = Router(View(view), policy, sent)
    return asyncio.run(router.choose(list(range(ids)), Tenant("t", "salt"), adapter=adapter))


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


def _lora(executor_id: str, running=(), held=(), max_loras: int = 0, load: int = 0) -> Candidate:
    return Candidate(
        executor_id,
        f"tcp://{executor_id}:1",
        running=load,
        lora_running=frozenset(running),
        lora_held=frozenset(held),
        max_loras=max_loras,
    )


def test_an_adapters_request_goes_where_it_runs_before_where_it_is_held_before_where_it_must_be_loaded():
    running, held, cold = _lora("r", running={"sql"}), _lora("h", held={"sql"}), _lora("c")
    assert route_request([cold, held, running], 100, 16, adapter="sql") is running
    assert route_request([cold, held], 100, 16, adapter="sql") is held
    # the base model pays for no adapter: the three cost the same
    assert len({route_cost(c, 100, 16) for c in (running, held, cold)}) == 1
    # the prompt's cached blocks still count beside residency: a long prefix held where it must be loaded wins
    holder = Candidate("p", "tcp://p:1", held=pool(40))
    assert route_request([running, holder], 1000, 16, adapter="sql") is holder
    # every step slot of the held one is taken by other adapters' requests: it would wait for one to drain
    full = _lora("f", running={"a", "b"}, held={"sql"}, max_loras=2)
    assert route_request([full, cold], 100, 16, adapter="sql") is cold
    assert (
        route_request(
            [_lora("f", running={"a"}, held={"sql"}, max_loras=2), cold], 100, 16, adapter="sql"
        ).executor_id
        == "f"
    )


def test_an_adapters_burst_stays_where_it_runs_until_that_executor_is_busier_than_a_load_elsewhere_costs():
    """As llm-d's LoRA affinity: residency first, then spread once its executors are saturated."""
    executors = [_lora("a", running={"sql"}), _lora("b"), _lora("c")]
    picks = []
    for _ in range(24):
        chosen = route_request(executors, 100, 16, random.Random(0), adapter="sql")
        picks.append(chosen.executor_id)
        chosen.running += 1  # it runs there now, under the adapter
        chosen.lora_running = chosen.lora_running | {"sql"}
    # a takes requests while its running decodes cost less than loading the adapter elsewhere (equal: either)
    first_spread = ADAPTER_DISK_LOAD_TOKENS // TOKENS_PER_RUNNING_REQUEST
    assert picks[:first_spread] == ["a"] * first_spread and set(picks[first_spread : first_spread + 2]) != {
        "a"
    }
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c"} and max(counts.values()) - min(counts.values()) <= first_spread


def _lora_info(executor_id: str, adapters: dict[str, str]) -> ExecutorInfo:
    info = _info(executor_id)
    info.lora, info.lora_adapters = True, adapters
    return info


def test_an_adapters_request_is_hashed_under_its_identity_and_goes_only_where_its_files_are_served():
    view = [
        (_lora_info("a", {"sql": "d1"}), Candidate("a", "tcp://a:1", running=5)),
        (_lora_info("b", {"sql": "d2"}), Candidate("b", "tcp://b:1")),
        (_lora_info("c", {"sql": "d1", "chat": "d3"}), Candidate("c", "tcp://c:1", running=9)),
        (_info("d"), Candidate("d", "tcp://d:1")),
    ]
    assert served_adapters(info.lora_adapters for info, _ in view) == {
        "chat": Adapter("chat", "d3"),
        "sql": Adapter("sql", "d1"),  # the digest most executors serve
    }
    choice = _choose(view, ids=100, adapter=Adapter("sql", "d1"))
    assert choice.executor.executor_id == "a" and choice.adapter == Adapter("sql", "d1")
    assert choice.block_hashes == hash_blocks(list(range(100)), 16, adapter_salt("salt", "sql@d1"))
    assert choice.block_hashes != hash_blocks(list(range(100)), 16, "salt")
    # admitted under files the executors have changed since: hashed again under those most of them serve now
    assert _choose(view, ids=100, adapter=Adapter("sql", "d0")).adapter == Adapter("sql", "d1")
    assert _choose(view, ids=100, adapter=Adapter("chat", "d3")).executor.executor_id == "c"
    assert _choose(view, ids=100).executor.executor_id in {"b", "d"}  # the base model: anywhere
    with pytest.raises(APIError) as unserved:
        _choose(view, ids=100, adapter=Adapter("gone", "d9"))
    assert unserved.value.status == 503 and "'gone'" in unserved.value.message
