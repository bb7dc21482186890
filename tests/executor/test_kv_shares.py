"""KV shares: a tenant's cached blocks within its share survive other tenants' bursts, scans pass through, and
running requests still get blocks (executor/kv/block_pool.py)."""

from __future__ import annotations

import random
from itertools import count

import pytest

from executor import LLM, SamplingParams
from executor.kv.block_pool import BlockPool
from executor.kv.cache_manager import KVCacheManager
from executor.request import Request, RequestStatus
from executor.scheduling.scheduler import Scheduler
from shared.tenant import ANONYMOUS_TENANT, Tenant

BLOCK = 4
_tags = count()


def whose(name: str | None, weight: float = 1.0) -> Tenant:
    """The tenant of that name, salted with it (None: the anonymous tenant)."""
    return ANONYMOUS_TENANT if name is None else Tenant(name, name, weight)


def make_request(rid, tokens, tenant, weight=1.0):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), tenant=whose(tenant, weight))


def blocks_by_name(pool: BlockPool) -> dict[str, tuple[int, int]]:
    return {tenant.name: counts for tenant, counts in pool.tenant_blocks().items()}


def start(kv: KVCacheManager, request: Request) -> bool:
    """Admit it as the scheduler does, then compute its whole prompt and publish its full blocks."""
    hit = kv.find_cached_prefix(request)
    if not kv.allocate(request, request.num_tokens - len(hit) * BLOCK, hit):
        return False
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return True


def cache(pool: BlockPool, tenant, n: int, weight=1.0) -> list[bytes]:
    """n blocks of tenant's, cached and freed, the first given first evicted: their hashes."""
    blocks = pool.allocate(n, whose(tenant, weight))
    hashes = [f"{tenant}-{next(_tags)}".encode() for _ in blocks]
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache(block, block_hash)
    pool.free(blocks)
    return hashes


def unique(n: int) -> list[int]:
    """n tokens no other call's start with (so no block of theirs is ever a cache hit for another)."""
    return [1 + next(_tags) % 40000] + list(range(1, n))


@pytest.mark.parametrize("shares", [True, False])
def test_a_tenants_cached_prefix_survives_anothers_burst_while_within_its_share(shares):
    kv = KVCacheManager(BlockPool(16, shares=shares), BLOCK)
    prefix = unique(12)
    b = make_request("b", prefix + [1], "B")
    assert start(kv, b)
    kv.free(b)  # B: three cached blocks, well within half the pool
    for burst in range(3):  # A's burst of unique prompts, as many at once as the pool lets in
        running = []
        for i in range(8):
            a = make_request(f"a{burst}.{i}", unique(13), "A")
            if not start(kv, a):
                break
            running.append(a)
        # with shares, A's burst waits behind itself once it holds blocks: it gets the free ones, never B's
        assert len(running) == (3 if shares else 4)
        for a in running:
            kv.free(a)
    hit = kv.find_cached_prefix(make_request("b2", prefix + [2], "B"))
    assert len(hit) == (3 if shares else 0)
    assert kv.pool.num_free_blocks == 16


@pytest.mark.parametrize("shares", [True, False])
def test_blocks_used_again_outlive_a_scan_of_blocks_used_once(shares):
    kv = KVCacheManager(BlockPool(8, shares=shares), BLOCK)
    hot = unique(8)
    for i in range(2):  # used twice: the second time from the cache
        request = make_request(f"hot{i}", hot + [i], None)
        assert start(kv, request)
        kv.free(request)
    for i in range(10):  # one-off prompts, one at a time: each would fit beside the hot prefix
        request = make_request(f"scan{i}", unique(9), None)
        assert start(kv, request)
        kv.free(request)
    assert len(kv.find_cached_prefix(make_request("hot", hot + [9], None))) == (2 if shares else 0)


def test_a_tenant_over_its_share_loses_its_own_blocks_first():
    pool = BlockPool(16, record_events=True)
    b_hashes = cache(pool, "B", 3)
    a_hashes = cache(pool, "A", 12)  # A owns 12 of 16 blocks, over its half
    pool.drain_events()
    # B's new request needs 4: the one free block, then A's least recently freed
    pool.allocate(4, whose("B"), evict_others=False)
    assert pool.drain_events() == ([], a_hashes[:3])
    assert blocks_by_name(pool) == {"A": (0, 9), "B": (4, 3)}
    assert all(pool.lookup(h) for h in b_hashes + a_hashes[3:])
    # down to its share (8 of 16), A's requests take its own blocks, not B's within its share
    pool.allocate(1, whose("A"), evict_others=False)
    pool.allocate(1, whose("A"), evict_others=False)
    assert pool.drain_events() == ([], a_hashes[3:5]) and all(pool.lookup(h) for h in b_hashes)


def test_shares_follow_weights_the_most_over_losing_first():
    pool = BlockPool(16)
    a_hashes = cache(pool, "A", 9, weight=3.0)  # share 12 of 16
    b_hashes = cache(pool, "B", 6, weight=1.0)  # share 4: two over
    assert pool.num_allocatable(whose("A", 3.0), evict_others=False) == 1 + 9 + 2
    pool.allocate(
        4, whose("A", 3.0), evict_others=False
    )  # the free block, B's two over its share, then A's own
    assert [pool.lookup(h) is not None for h in b_hashes] == [False, False, True, True, True, True]
    assert [pool.lookup(h) is not None for h in a_hashes] == [False] + [True] * 8
    assert blocks_by_name(pool) == {"A": (4, 8), "B": (0, 4)}
    # B weighs as much as A now: A, at 12 of 16, is the one over
    pool.allocate(2, whose("B", 3.0), evict_others=False)
    assert all(pool.lookup(h) for h in b_hashes[2:]) and blocks_by_name(pool)["A"] == (4, 6)


def test_a_running_request_gets_blocks_only_in_share_blocks_of_others_can_give():
    kv = KVCacheManager(BlockPool(8), BLOCK)
    b = make_request("b", unique(13), "B")
    assert start(kv, b)
    kv.free(b)  # B: 3 cached blocks, within its half; 5 free blocks
    a = make_request("a", unique(16), "A")
    assert start(kv, a)  # A holds 4 blocks; one free left
    second = make_request("a2", unique(5), "A")
    assert not kv.allocate(second, 5)  # a new request of A's would need one of B's
    assert "a2" not in kv.tables and blocks_by_name(kv.pool)["B"] == (0, 3)
    assert kv.allocate(a, 8)  # a running one takes the free block and one of B's
    assert blocks_by_name(kv.pool) == {"A": (6, 0), "B": (0, 2)}


def test_a_tenants_first_request_may_take_others_blocks_when_it_needs_more_than_its_share():
    """Otherwise it would wait forever: nothing of its own runs to give blocks back."""
    kv = KVCacheManager(BlockPool(16), BLOCK)
    cache(kv.pool, "B", 12, weight=3.0)  # B's share: 12 of 16, all cached
    big = make_request("a", unique(32), "A")  # 8 blocks; A's share is 4
    assert start(kv, big)
    assert blocks_by_name(kv.pool) == {"A": (8, 0), "B": (0, 8)}
    assert not kv.allocate(make_request("a2", unique(4), "A"), 4)  # while it holds some, it waits


@pytest.mark.parametrize("shares", [True, False])
def test_a_burst_through_the_scheduler_leaves_a_prefix_within_its_share_and_everything_comes_back(shares):
    kv = KVCacheManager(BlockPool(64, shares=shares), BLOCK)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    prefix = unique(16)
    sched.add(make_request("b", prefix + [1], "B"))
    for i in range(12):  # 72 blocks in all, through the 59 B leaves
        sched.add(make_request(f"a{i}", unique(20), "A"))
    while sched.num_unfinished:
        out = sched.schedule()
        done = [r for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens]
        sched.update_from_output(out, done, [[7] for _ in done])
    assert kv.pool.num_free_blocks == 64 and all(held == 0 for held, _ in kv.pool.tenant_blocks().values())
    assert len(kv.find_cached_prefix(make_request("b2", prefix + [2], "B"))) == (4 if shares else 0)


def check_counts(pool: BlockPool) -> None:
    """The pool's counts against its blocks: what is free, and each tenant's held and cached blocks."""
    free = [b for b in pool.blocks if b.ref_count == 0]
    assert pool.num_free_blocks == len(free)
    expected: dict = {}
    for b in pool.blocks:
        if b.ref_count or b.block_hash is not None:
            held, idle = expected.get(b.owner, (0, 0))
            expected[b.owner] = (held + 1, idle) if b.ref_count else (held, idle + 1)
    assert pool.tenant_blocks() == expected
    assert all(pool.lookup(h).block_hash == h for h in pool.cached_hashes())


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_never_leaks_and_allocate_never_breaks_its_word(seed):
    rng = random.Random(seed)
    shares = seed % 3 != 0
    kv = KVCacheManager(BlockPool(24, shares=shares), BLOCK)
    tenants = {"A": 1.0, "B": 2.0, None: 1.0, "C": 0.5}
    prefixes = {t: [unique(rng.randrange(4, 17)) for _ in range(3)] for t in tenants}
    running: list[Request] = []
    for step in range(300):
        if running and rng.random() < 0.4:
            request = running.pop(rng.randrange(len(running)))
            kv.free(request)
        elif running and rng.random() < 0.5:  # a running one grows (its allocate may evict anyone's)
            request = rng.choice(running)
            grow = rng.randrange(1, 9)
            if kv.allocate(request, grow):
                request.append_token(1)
                request.token_ids.extend([1] * (grow - 1))
                request.num_computed_tokens += grow
                kv.cache_full_blocks(request)
        else:
            tenant = rng.choice(list(tenants))
            tokens = rng.choice(prefixes[tenant]) + unique(rng.randrange(1, 12))
            request = make_request(f"r{step}", tokens, tenant, tenants[tenant])
            if start(kv, request):  # raises if allocate said yes and then could not
                running.append(request)
        check_counts(kv.pool)
    for request in running:
        kv.free(request)
    check_counts(kv.pool)
    assert kv.pool.num_free_blocks == 24


@pytest.mark.parametrize("kv_shares", [True, False])
def test_engine_keeps_a_tenants_prefix_through_anothers_burst(tiny_models, kv_shares):
    # 16 blocks of 16 tokens (a block of the tiny llama is 8 KiB)
    llm = LLM(tiny_models["llama"], kv_cache_memory=16 * 8192, max_model_len=256, kv_shares=kv_shares)
    engine = llm.engine
    assert engine.kv.pool.num_blocks == 16

    def run(requests: dict[str, tuple[list[int], str]]) -> dict[str, int]:
        """Run them together to the end: each one's cached prompt tokens."""
        for rid, (prompt, tenant) in requests.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0), whose(tenant))
        cached = {}
        while engine.has_unfinished():
            for out in engine.step().outputs:
                cached[out.request_id] = out.num_cached_tokens
        return cached

    prefix = unique(48)
    run({"b": (prefix + [1], "B")})
    run({f"a{i}": (unique(40), "A") for i in range(8)})
    assert run({"b2": (prefix + [2], "B")})["b2"] == (48 if kv_shares else 0)
    assert engine.kv.pool.num_free_blocks == 16
