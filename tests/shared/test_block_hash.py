from shared.block_hash import hash_block, hash_blocks, max_cached_blocks, root_hash


def test_equal_prefixes_give_equal_chains():
    a = hash_blocks(list(range(40)), 16)
    b = hash_blocks(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block is never hashed


def test_a_change_anywhere_changes_every_later_hash():
    a = hash_blocks(list(range(48)), 16)
    tokens = list(range(48))
    tokens[3] = 1000
    b = hash_blocks(tokens, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_salts_give_disjoint_chains():
    tokens = list(range(64))
    plain, alice, bob = (
        hash_blocks(tokens, 16),
        hash_blocks(tokens, 16, "alice"),
        hash_blocks(tokens, 16, "bob"),
    )
    assert not set(plain) & set(alice) and not set(alice) & set(bob)
    assert hash_blocks(tokens, 16, "alice") == alice


def test_extending_a_chain_equals_hashing_it_whole():
    tokens = list(range(100))
    head = hash_blocks(tokens[:40], 16, "s")
    assert hash_blocks(tokens, 16, "s", head) == hash_blocks(tokens, 16, "s")


def test_hash_is_stable_across_processes():
    # a fixed value: Python's hash() is salted per process and would fail this
    assert hash_block(root_hash(None), [1, 2, 3]).hex() == hash_block(root_hash(b""), [1, 2, 3]).hex()
    assert len(hash_block(root_hash("x"), [1])) == 16


def test_extras_separate_otherwise_equal_blocks():
    parent = root_hash()
    assert hash_block(parent, [1, 2], b"img:1") != hash_block(parent, [1, 2], b"img:2")


def test_a_prefix_hit_never_covers_the_last_token():
    assert [max_cached_blocks(n, 16) for n in (1, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
