import os
import stat

import pytest
import torch

from executor.kv.tiers.block_files import MAX_HEADER_BYTES, file_name
from executor.kv.tiers.disk_tier import DiskTier
from executor.kv.tiers.fingerprint import KVFingerprint, tier_owner
from shared.block_hash import hash_blocks
from shared.tenant import ANONYMOUS_TENANT, Tenant

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, KV heads, head_dim


def fingerprint(dtype="float32", model="model-a"):
    return KVFingerprint(model, dtype, 4, SHAPE, "auto/int8")


def make_tier(directory, slots=8, dtype=torch.float32, model="model-a", shares=True):
    fp = fingerprint(str(dtype).removeprefix("torch."), model)
    payload_bytes = torch.empty(SHAPE, dtype=dtype).nbytes
    return DiskTier(directory, slots * (MAX_HEADER_BYTES + payload_bytes), fp, dtype, shares=shares)


def hashes(n, salt="salt"):
    return hash_blocks(list(range(4 * n)), 4, salt)


def put(tier, tenant, block_hash, payload=None):
    """As the coordinator does: a slot from the index for the tenant, the file written, the slot cached and idle."""
    owner = tier_owner(tenant)
    block = tier.index.allocate(1, owner)[0]
    payload = torch.randn(SHAPE) if payload is None else payload
    tier.write(block.block_id, block_hash, owner, payload)
    tier.index.cache(block, block_hash)
    tier.index.free([block])
    return payload


def get(tier, block_hash):
    block = tier.index.lookup(block_hash)
    return None if block is None else tier.read(block.block_id, block_hash)


def files(directory):
    return sorted(name for name in os.listdir(directory))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_payload_comes_back_unchanged(tmp_path, dtype):
    tier = make_tier(tmp_path / "kv", dtype=dtype)
    [h] = hashes(1)
    payload = torch.randn(SHAPE).to(dtype)
    put(tier, Tenant("a", "s"), h, payload.clone())
    out = get(tier, h)
    assert out.dtype == dtype and out.shape == SHAPE and torch.equal(out, payload)


def test_the_directory_and_files_are_the_users_alone(tmp_path):
    tier = make_tier(tmp_path / "new" / "kv")
    put(tier, ANONYMOUS_TENANT, hashes(1)[0])
    assert stat.S_IMODE((tmp_path / "new" / "kv").stat().st_mode) == 0o700
    [name] = files(tier.directory)
    assert stat.S_IMODE((tier.directory / name).stat().st_mode) == 0o600
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    make_tier(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_the_salt_never_reaches_the_disk(tmp_path):
    tier = make_tier(tmp_path)
    put(tier, Tenant("a", "the-secret-salt"), hashes(1)[0])
    [name] = files(tmp_path)
    assert b"the-secret-salt" not in (tmp_path / name).read_bytes()
    with pytest.raises(ValueError, match="tier_owner"):
        tier.write(0, hashes(2)[1], Tenant("a", "the-secret-salt"), torch.randn(SHAPE))


def corrupt(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-3])


@pytest.mark.parametrize("damage", [corrupt, truncate])
def test_a_damaged_file_is_refused_removed_and_never_served(tmp_path, damage):
    tier = make_tier(tmp_path)
    [h] = hashes(1)
    put(tier, ANONYMOUS_TENANT, h)
    damage(tmp_path / file_name(h))
    assert get(tier, h) is None
    assert files(tmp_path) == [] and tier.rejected == 1
    assert get(tier, h) is None  # missing now: still nothing served
    assert tier.rejected == 2


def test_another_fingerprints_file_is_foreign(tmp_path):
    [h] = hashes(1)
    put(make_tier(tmp_path, model="model-a"), ANONYMOUS_TENANT, h)
    other = make_tier(tmp_path, model="model-b")
    assert other.read(0, h) is None and other.rejected == 1 and files(tmp_path) == []


def test_a_file_under_another_hashs_name_is_refused(tmp_path):
    tier = make_tier(tmp_path)
    h1, h2 = hashes(2)
    put(tier, ANONYMOUS_TENANT, h1)
    os.rename(tmp_path / file_name(h1), tmp_path / file_name(h2))
    assert tier.read(1, h2) is None and tier.rejected == 1 and files(tmp_path) == []


def test_a_restart_finds_the_blocks_and_their_owners(tmp_path):
    tier = make_tier(tmp_path)
    a, b = Tenant("a", "salt-a", weight=3.0), Tenant("b", "salt-b")
    ha, hb = hashes(2, "salt-a"), hashes(1, "salt-b")
    payloads = {h: put(tier, a, h) for h in ha} | {hb[0]: put(tier, b, hb[0])}

    restarted = make_tier(tmp_path)
    assert restarted.scan() == 3
    for h, payload in payloads.items():
        assert torch.equal(get(restarted, h), payload)
    owner = restarted.index.lookup(ha[0]).owner
    assert owner == tier_owner(a) and owner.weight == 3.0 and owner.cache_salt != "salt-a"
    assert restarted.index.lookup(hb[0]).owner == tier_owner(b)
    assert restarted.index.num_free_blocks == 8  # cached and idle: reusable, nothing held
    added, removed = restarted.index.drain_events()
    assert sorted(added) == sorted(payloads) and removed == []


def test_a_scan_removes_temp_damaged_and_foreign_files_and_leaves_others(tmp_path):
    h1, h2, h3, h4 = hashes(4)
    put(make_tier(tmp_path, model="model-b"), ANONYMOUS_TENANT, h4)
    tier = make_tier(tmp_path)
    for h in (h1, h2, h3):
        put(tier, ANONYMOUS_TENANT, h)
    truncate(tmp_path / file_name(h2))
    (tmp_path / f"{h3.hex()}.0.kvb.tmp").write_bytes(b"half a write")
    (tmp_path / "notes.txt").write_text("not ours")

    restarted = make_tier(tmp_path)
    assert restarted.scan() == 2  # h1 and h3; a truncated file is found by its size, unread
    assert restarted.rejected == 2  # truncated h2, foreign h4
    assert files(tmp_path) == sorted([file_name(h1), file_name(h3), "notes.txt"])
    assert restarted.index.lookup(h2) is None and restarted.index.lookup(h4) is None


def test_a_scan_over_capacity_keeps_the_newest(tmp_path):
    tier = make_tier(tmp_path, slots=4)
    hs = hashes(4)
    for i, h in enumerate(hs):
        put(tier, ANONYMOUS_TENANT, h)
        os.utime(tmp_path / file_name(h), ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    smaller = make_tier(tmp_path, slots=2)
    assert smaller.scan() == 2
    assert files(tmp_path) == sorted(file_name(h) for h in hs[2:])
    # the older of the two kept goes first when a new block needs a slot
    put(smaller, ANONYMOUS_TENANT, hashes(5)[4])
    assert smaller.index.lookup(hs[2]) is None and smaller.index.lookup(hs[3]) is not None
    assert files(tmp_path) == sorted(file_name(h) for h in (hs[3], hashes(5)[4]))


def test_more_blocks_than_slots_keep_at_most_one_file_per_slot(tmp_path):
    tier = make_tier(tmp_path, slots=3)
    hs = hashes(10)
    for h in hs:
        put(tier, ANONYMOUS_TENANT, h)
    assert files(tmp_path) == sorted(file_name(h) for h in hs[-3:])
    assert [get(tier, h) is not None for h in hs[-3:]] == [True] * 3


def test_a_hash_written_again_from_another_slot_keeps_its_file(tmp_path):
    # slot 0 wrote h, lost it to h2 in the index, then h was written from slot 1: reusing slot 0 must not
    # remove the file slot 1 now holds
    tier = make_tier(tmp_path, slots=3)
    h, h2, h3 = hashes(3)
    payload = torch.randn(SHAPE)
    tier.write(0, h, ANONYMOUS_TENANT, torch.randn(SHAPE))
    tier.write(1, h, ANONYMOUS_TENANT, payload)
    tier.write(0, h2, ANONYMOUS_TENANT, torch.randn(SHAPE))
    assert torch.equal(tier.read(1, h), payload)
    tier.write(1, h3, ANONYMOUS_TENANT, torch.randn(SHAPE))
    assert files(tmp_path) == sorted([file_name(h2), file_name(h3)])


def test_a_tenant_within_its_share_keeps_its_blocks_through_anothers_burst(tmp_path):
    tier = make_tier(tmp_path, slots=8)
    a, b = Tenant("a", "salt-a"), Tenant("b", "salt-b")
    kept = {h: put(tier, a, h) for h in hashes(3, "salt-a")}  # within its share: 8 x 1/2
    for h in hashes(20, "salt-b"):
        put(tier, b, h)
    for h, payload in kept.items():
        assert torch.equal(get(tier, h), payload)
    assert len(files(tmp_path)) <= 8


def test_a_capacity_below_one_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_offload_disk"):
        DiskTier(tmp_path, MAX_HEADER_BYTES, fingerprint(), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        DiskTier(tmp_path, 10**6, fingerprint("bfloat16"), torch.float32)


def test_folders_it_makes_above_its_own_are_private_too(tmp_path):
    fp = KVFingerprint("m", "float32", 16, (2, 2, 16, 2, 16), "auto/int8")
    DiskTier(tmp_path / "kv" / "executor-0", 10 * 2**20, fp, torch.float32)
    for folder in (tmp_path / "kv", tmp_path / "kv" / "executor-0"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
