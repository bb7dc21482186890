"""The Triton paged-attention and cache-write kernels against their torch twins in kvkernels.torch_twins.

Where no CUDA device exists, this process runs Triton in its interpreter on CPU tensors (TRITON_INTERPRET=1 has
to be set before triton is first imported, hence before the imports below); with CUDA, the same cases run
compiled on the GPU. The interpreter is slow: the cases keep few heads and sequences.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())
pytest.importorskip("triton")

from kvkernels import torch_twins, triton_attention, triton_cache  # noqa: E402
from tests.kernels.test_paged_attention import random_batch  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETING, reason="Triton compiles for CUDA in this process (TRITON_INTERPRET unset)"
        ),
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            INTERPRETING or not torch.cuda.is_available(), reason="needs CUDA without the interpreter"
        ),
    ),
]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}

# (new tokens, context length after the step) per sequence: a decode at position 0, a decode over a partial
# block, a fresh prefill, a prefill chunk after cached context, and another decode
MIXED = ([1, 1, 20, 9, 1], [1, 37, 20, 50, 33])


def run_both(q_lens, seq_lens, device, dtype=torch.float32, num_kv_splits=None, **shape):
    query, key_cache, value_cache, table, lens, starts = random_batch(q_lens, seq_lens, **shape)
    query, key_cache, value_cache = (t.to(dtype) for t in (query, key_cache, value_cache))
    expected = torch_twins.paged_attention(query, key_cache, value_cache, table, lens, starts, scale=0.125)
    on_device = [t.to(device) for t in (query, key_cache, value_cache, table, lens, starts)]
    got = triton_attention.paged_attention(*on_device, scale=0.125, num_kv_splits=num_kv_splits)
    assert got.dtype == dtype and got.shape == query.shape
    return got.cpu(), expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_reference(device, head_dim, group, block_size):
    kv_heads = 2 if group == 1 else 1
    got, expected = run_both(
        *MIXED, device, block_size=block_size, heads=group * kv_heads, kv_heads=kv_heads, dim=head_dim
    )
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [8, 80])  # below tl.dot's minimum; not a power of two
def test_head_dims_are_padded_and_masked(device, head_dim):
    got, expected = run_both(*MIXED, device, num_kv_splits=2, heads=4, kv_heads=2, dim=head_dim)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_fp32(device, dtype):
    got, expected = run_both(*MIXED, device, dtype, block_size=16, heads=6, kv_heads=2, dim=64)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_decode_matches_reference_whole_or_split(device, block_size, num_kv_splits):
    got, expected = run_both(
        [1], [2000], device, num_kv_splits=num_kv_splits, block_size=block_size, heads=8, kv_heads=1, dim=128
    )
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_combines_splits_that_saw_nothing(device):
    # a length-1 decode leaves three of its four splits empty; their weight in the combination must be zero
    got, expected = run_both([1, 1, 1], [1, 100, 700], device, num_kv_splits=4, heads=3, kv_heads=1, dim=64)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_serves_prefill_chunks_too(device):
    got, expected = run_both(*MIXED, device, num_kv_splits=3, heads=4, kv_heads=2, dim=64)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_matches_reference(device, dtype, block_size):
    g = torch.Generator().manual_seed(3)
    num_blocks, heads, dim = 6, 3, 128
    key = torch.randn(11, heads, dim, generator=g).to(dtype)
    value = torch.randn(11, heads, dim, generator=g).to(dtype)
    # scattered slots: a partial block, a block's last slot, blocks out of order
    slots = torch.randperm(num_blocks * block_size, generator=g)[:11]
    expected = [torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype) for _ in range(2)]
    torch_twins.reshape_and_cache(key, value, *expected, slots)
    caches = [c.to(device) for c in torch.zeros(2, num_blocks, block_size, heads, dim, dtype=dtype)]
    triton_cache.reshape_and_cache(key.to(device), value.to(device), *caches, slots.to(device))
    assert torch.equal(caches[0].cpu(), expected[0]) and torch.equal(caches[1].cpu(), expected[1])


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_writes_into_a_layer_view_of_the_whole_cache(device):
    """The engine hands each layer strided views of one [layers, 2, N, B, H, D] tensor."""
    whole = torch.zeros(2, 2, 4, 16, 2, 64, device=device)
    key, value = torch.randn(5, 2, 64, device=device), torch.randn(5, 2, 64, device=device)
    slots = torch.tensor([63, 0, 17, 18, 40], device=device)
    triton_cache.reshape_and_cache(key, value, whole[1, 0], whole[1, 1], slots)
    flat = whole.view(2, 2, 64, 2, 64)
    assert torch.equal(flat[1, 0, slots], key) and torch.equal(flat[1, 1, slots], value)
    assert whole[0].abs().sum() == 0  # the other layer is untouched


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_skips_padding_slots(device):
    key, value = torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    slots = torch.tensor([5, -1, 31, -1])
    expected = [torch.zeros(2, 16, 3, 64) for _ in range(2)]
    torch_twins.reshape_and_cache(key, value, *expected, slots)
    caches = [torch.zeros(2, 16, 3, 64, device=device) for _ in range(2)]
    triton_cache.reshape_and_cache(key.to(device), value.to(device), *caches, slots.to(device))
    assert torch.equal(caches[0].cpu(), expected[0]) and torch.equal(caches[1].cpu(), expected[1])
    assert expected[0].view(32, 3, 64)[[5, 31]].abs().sum() > 0
