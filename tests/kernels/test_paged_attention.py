"""The CPU paths (batched torch, and the C++ kernels) against the torch twins."""

from __future__ import annotations

import pytest
import torch

from kvkernels import torch_paged, torch_twins
from kvkernels.cpu_extension import cpu_kernels


def random_batch(q_lens, seq_lens, block_size=16, heads=8, kv_heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    # scattered, non-contiguous block ids per sequence
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    query = torch.randn(sum(q_lens), heads, dim, generator=g)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


CASES = {
    "decodes": ([1, 1, 1, 1], [1, 17, 64, 300]),
    "prefills": ([5, 33], [5, 33]),
    "chunk-after-context": ([7, 20], [40, 20]),
    "mixed": ([1, 12, 1, 50, 1], [90, 30, 16, 50, 200]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_path_matches_reference(case, block_size, monkeypatch):
    monkeypatch.setattr(torch_paged, "cpu_kernels", lambda: None)
    args = random_batch(*CASES[case], block_size=block_size)
    expected = torch_twins.paged_attention(*args, scale=0.17)
    assert torch.allclose(torch_paged.paged_attention(*args, scale=0.17), expected, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_cpu_decode_kernel_matches_reference(case):
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    args = random_batch(*CASES[case], block_size=16)
    expected = torch_twins.paged_attention(*args, scale=0.17)
    assert torch.allclose(torch_paged.paged_attention(*args, scale=0.17), expected, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 64), (8, 2, 128), (4, 4, 32), (6, 3, 40)])
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 300, 333], [333]], ids=["many", "one"])
@pytest.mark.parametrize("scale", [0.125, 1.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("block_size", [16, 12, 4])
def test_cpu_decode_kernel_block_by_block(heads, kv_heads, dim, seq_lens, scale, block_size):
    """The decode kernel's running softmax across blocks: query heads per kv head of 1 to 4, head sizes of its
    vector paths and one of none, full and partial last blocks, blocks of a multiple of its 8 scores at a time
    and not, a sequence's kv heads in one work item (many sequences) and apart (one), and scores whose maximum
    moves late (peaked), so that the output is rescaled."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    args = random_batch(
        [1] * len(seq_lens), seq_lens, block_size, heads=heads, kv_heads=kv_heads, dim=dim, seed=5
    )
    expected = torch_twins.paged_attention(*args, scale=scale)
    assert torch.allclose(torch_paged.paged_attention(*args, scale=scale), expected, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("kv_heads", "seq_lens"), [(3, [333]), (1, [333]), (1, [1, 333]), (1, [40, 17]), (2, [31])]
)
def test_cpu_decode_kernel_cuts_a_few_contexts_into_parts(threads, kv_heads, seq_lens):
    """The kernel cuts each context of more than 256 positions into parts of whole blocks and merges their
    softmaxes: beside a sequence too short to cut (one position, 17, 31), on every thread count, a sequence's kv
    heads together or apart."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    args = random_batch([1] * len(seq_lens), seq_lens, heads=3 * kv_heads, kv_heads=kv_heads, dim=64, seed=11)
    expected = torch_twins.paged_attention(*args, scale=0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch_paged.paged_attention(*args, scale=0.3)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize(
    "seq_lens",
    [[2900], [1, 700, 129, 3000], [97 * i + 40 for i in range(16)]],
    ids=["one", "few", "sixteen"],
)
def test_cpu_decode_kernel_gives_the_same_bits_on_any_thread_count(seq_lens):
    """The default model's heads (9 sharing 3 kv heads of 64): contexts of a few thousand positions, cut into parts
    and merged, give the same bits on 1 to 4 threads (the CPU thread governor moves between them), one stream,
    a few, and sixteen (whose kv heads run together)."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    args = random_batch([1] * len(seq_lens), seq_lens, heads=9, kv_heads=3, dim=64, seed=13)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            outs.append(torch_paged.paged_attention(*args, scale=0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(outs[0], torch_twins.paged_attention(*args, scale=0.125), atol=1e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_cpu_decode_kernel_ignores_what_lies_past_the_context():
    """A partial last block's unused positions hold whatever the pool had there (here NaN): the kernel reads
    them with the rest of the block and must leave them out of the scores and the values."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    seq_lens = [1, 5, 17, 40, 333]
    query, key_cache, value_cache, table, lens, starts = random_batch(
        [1] * len(seq_lens), seq_lens, heads=9, kv_heads=3, dim=64, seed=7
    )
    expected = torch_twins.paged_attention(query, key_cache, value_cache, table, lens, starts, scale=0.125)
    for row, n in enumerate(seq_lens):
        last = table[row, (n - 1) // 16]
        key_cache[last, n % 16 or 16 :] = float("nan")
        value_cache[last, n % 16 or 16 :] = float("nan")
    out = torch_paged.paged_attention(query, key_cache, value_cache, table, lens, starts, scale=0.125)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 40), (6, 2, 128)])
def test_cpu_prefill_kernel_matches_reference(heads, kv_heads, dim):
    """Long chunks, chunks after cached context and decodes in one call, in SmolLM2's shape (9 heads sharing 3
    kv heads of 64) and in head sizes that are not a multiple of the kernel's 16 columns."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    q_lens, seq_lens = [1, 300, 7, 1, 97, 2], [50, 300, 200, 1, 130, 2]
    args = random_batch(q_lens, seq_lens, heads=heads, kv_heads=kv_heads, dim=dim, seed=3)
    expected = torch_twins.paged_attention(*args, scale=dim**-0.5)
    assert torch.allclose(torch_paged.paged_attention(*args, scale=dim**-0.5), expected, atol=1e-5)


def test_reshape_and_cache_matches_reference():
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    slots = torch.tensor([3, 4, 5, 17, 30, 31, 0, 9, 10])
    caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
    torch_twins.reshape_and_cache(key, value, caches[0], caches[1], slots)
    torch_paged.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_reshape_and_cache_skips_padding_slots():
    """Slot -1 marks a padding token (a CUDA graph's padded batch): it writes nothing, the others land."""
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([5, -1, 12, -1])
    for write in (torch_twins.reshape_and_cache, torch_paged.reshape_and_cache):
        caches = [torch.zeros(2, 8, 2, 8) for _ in range(2)]
        write(key, value, *caches, slots)
        flat = caches[0].view(16, 2, 8)
        assert torch.equal(flat[5], key[0]) and torch.equal(flat[12], key[2])
        others = [i for i in range(16) if i not in (5, 12)]
        assert flat[others].abs().sum() == 0
        assert torch.equal(caches[1].view(16, 2, 8)[12], value[2])


def test_decode_groups_cover_every_row_once_with_little_padding():
    lengths = [10, 500, 30, 480, 35, 11, 250]
    groups = torch_paged.decode_groups(lengths, list(range(len(lengths))))
    assert sorted(s for g in groups for s in g) == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * max(lengths[s] for s in group)
        assert padded <= 1.25 * sum(lengths[s] for s in group) or len(group) == 1


def test_the_torch_backend_builds_the_cpu_kernels_before_serving(monkeypatch):
    built = []
    monkeypatch.setattr(torch_paged, "cpu_kernels", lambda: built.append(True))
    torch_paged.build(torch.device("cpu"), torch.bfloat16)  # not a dtype the kernel serves
    assert built == []
    torch_paged.build(torch.device("cpu"), torch.float32)
    assert built == [True]
