import pytest

from executor.kv.block_pool import BlockPool
from executor.kv.cache_manager import KVCacheManager
from executor.request import Request
from shared.sampling_params import SamplingParams
from shared.tenant import ANONYMOUS_TENANT, Tenant


def make_request(rid, tokens, salt=None):
    tenant = ANONYMOUS_TENANT if salt is None else Tenant(salt, salt)
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), tenant=tenant)


def test_allocate_and_free_track_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.ref_count for b in a] == [1, 1, 1] and pool.num_free_blocks == 1
    pool.touch(a[:1])
    assert a[0].ref_count == 2
    pool.free(a)
    assert a[0].ref_count == 1 and pool.num_free_blocks == 3
    pool.free(a[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_freed_cached_blocks_stay_reusable_until_evicted_lru_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, bytes([i]))
    pool.free([blocks[1], blocks[0], blocks[2]])  # LRU order: 1, 0, 2
    assert pool.lookup(bytes([0])) is blocks[0]
    (first,) = pool.allocate(1)
    assert first is blocks[1] and pool.lookup(bytes([1])) is None  # evicted, its hash dropped
    assert pool.lookup(bytes([0])) is blocks[0] and pool.lookup(bytes([2])) is blocks[2]
    (second,) = pool.allocate(1)
    assert second is blocks[0]


def test_touching_a_free_cached_block_takes_it_out_of_eviction():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], b"h")
    pool.free(blocks)
    pool.touch([pool.lookup(b"h")])
    (other,) = pool.allocate(1)
    assert other is blocks[1] and pool.num_free_blocks == 0


def test_shared_prefix_blocks_are_shared_and_last_token_never_hit():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 4)
    first = make_request("a", range(12))
    assert len(kv.find_cached_prefix(first)) == 0
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    second = make_request("b", list(range(12)) + [50, 51])
    hit = kv.find_cached_prefix(second)
    assert [b.block_id for b in hit.blocks] == kv.block_ids(first).tolist()
    assert kv.allocate(second, 14 - 12, hit)
    # the hit joins the table, one new block after it; counting it as computed is the scheduler's job
    assert (
        kv.tables["b"][:3] == list(hit.blocks)
        and len(kv.tables["b"]) == 4
        and second.num_computed_tokens == 0
    )
    assert all(b.ref_count == 2 for b in hit.blocks)
    # exactly the cached prompt again: the last block is not reused, its last token must be computed
    third = make_request("c", range(12))
    assert len(kv.find_cached_prefix(third)) == 2


def test_salts_never_share_blocks():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 4)
    alice = make_request("a", range(12), salt="alice")
    kv.allocate(alice, 12)
    alice.num_computed_tokens = 12
    kv.cache_full_blocks(alice)
    assert len(kv.find_cached_prefix(make_request("b", range(13), salt="bob"))) == 0
    assert len(kv.find_cached_prefix(make_request("c", range(13), salt="alice"))) == 3


def test_allocation_fails_cleanly_when_short_and_free_returns_everything():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, 4)
    a = make_request("a", range(10))
    assert kv.allocate(a, 10)  # 3 blocks
    b = make_request("b", range(100, 110))
    assert not kv.allocate(b, 10)
    assert pool.num_free_blocks == 1 and "b" not in kv.tables
    kv.free(a)
    assert pool.num_free_blocks == 4


def test_prefix_caching_off_finds_nothing():
    pool = BlockPool(8, enable_caching=False)
    kv = KVCacheManager(pool, 4)
    a = make_request("a", range(9))
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    assert len(kv.find_cached_prefix(make_request("b", range(9)))) == 0


def test_cache_events_are_recorded_only_when_asked():
    offline = BlockPool(2)
    offline.cache(offline.allocate(1)[0], b"h")
    assert offline.drain_events() == ([], [])
    assert offline._events is None  # nothing accumulates for a pool nobody publishes

    pool = BlockPool(2, record_events=True)
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    assert sorted(pool.drain_events()[0]) == [b"a", b"b"] and pool.drain_events() == ([], [])
    pool.free([a, b])
    pool.allocate(1)  # evicts a, the least recently freed
    assert pool.drain_events() == ([], [b"a"])


def test_cache_events_net_out_within_one_drain_interval():
    pool = BlockPool(1, record_events=True)
    (block,) = pool.allocate(1)
    pool.cache(block, b"x")
    pool.free([block])
    (block,) = pool.allocate(1)  # x cached then evicted before anyone drained: never published
    assert pool.drain_events() == ([], [])

    pool.cache(block, b"y")
    pool.drain_events()
    pool.free([block])
    (block,) = pool.allocate(1)  # y evicted ...
    pool.cache(block, b"y")  # ... and cached again: still held, nothing to tell
    assert pool.drain_events() == ([], [])
    pool.free([block])
    (block,) = pool.allocate(1)
    pool.cache(block, b"z")
    assert pool.drain_events() == ([b"z"], [b"y"])


def test_the_block_table_rows_follow_allocation_and_are_reused_after_free():
    pool = BlockPool(64)
    kv = KVCacheManager(pool, 4, max_blocks_per_seq=2, rows=1)  # both must grow
    a, b = make_request("a", range(6)), make_request("b", range(30, 39))
    assert kv.allocate(a, 6) and kv.allocate(b, 9)
    assert kv.block_ids(a).tolist() == [blk.block_id for blk in kv.tables["a"]]
    a.num_computed_tokens = 6
    assert kv.allocate(a, 7)  # 13 tokens: four blocks, past the table's first width
    assert kv.block_ids(a).tolist() == [blk.block_id for blk in kv.tables["a"]] and len(kv.block_ids(a)) == 4
    assert kv.block_ids(b).tolist() == [blk.block_id for blk in kv.tables["b"]]
    kv.free(a)
    c = make_request("c", range(50, 53))
    assert kv.allocate(c, 3)
    assert kv.block_ids(c).tolist() == [blk.block_id for blk in kv.tables["c"]]
    assert len(kv.block_ids(a)) == 0


def test_tokens_stored_count_a_block_shared_by_several_requests_once():
    kv = KVCacheManager(BlockPool(16), 4)
    a = make_request("a", range(12))
    assert kv.allocate(a, 12)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    b = make_request("b", list(range(12)) + [50, 51])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 3 and kv.allocate(b, 2, hit)
    b.num_computed_tokens = 12  # the hit, as the scheduler counts it
    assert kv.num_tokens_stored([a, b]) == 12
    b.num_computed_tokens = 14
    assert kv.num_tokens_stored([a, b]) == 14 and kv.num_tokens_stored([a]) == 12
