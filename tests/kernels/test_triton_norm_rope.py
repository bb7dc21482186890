"""The Triton RMSNorm (with and without the residual add) and rotary kernels against their torch twins.

As in test_triton_attention: Triton's interpreter on CPU tensors where no CUDA device exists, compiled on CUDA
otherwise."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())
pytest.importorskip("triton")

from kvkernels import torch_twins, triton_norm_rope  # noqa: E402
from tests.kernels.test_triton_attention import DEVICES  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# rounding to the dtype once; fp32 differs only in summation order
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64])  # SmolLM2-135M's width is not a power of two
def test_rms_norm_matches_reference(device, dtype, hidden):
    x, weight = randn(7, hidden, dtype=dtype) * 3, randn(hidden, dtype=dtype, seed=1)
    got = triton_norm_rope.rms_norm(x.to(device), weight.to(device), 1e-5).cpu()
    expected = torch_twins.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(device, dtype):
    x, residual = randn(5, 2, 576, dtype=dtype), randn(5, 2, 576, dtype=dtype, seed=2)
    weight = randn(576, dtype=dtype, seed=1)
    normed, summed = triton_norm_rope.add_rms_norm(x.to(device), residual.to(device), weight.to(device), 1e-6)
    expected_normed, expected_summed = torch_twins.add_rms_norm(x, residual, weight, 1e-6)
    # one rounding of an exact sum: bit for bit, except that Triton's interpreter rounds to bf16 by truncation
    ulp = 2**-7 if INTERPRETING and dtype == torch.bfloat16 else 0
    torch.testing.assert_close(summed.cpu(), expected_summed, atol=0, rtol=ulp)
    torch.testing.assert_close(normed.cpu(), expected_normed, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_reference_rms_norm_is_the_models_norm():
    from executor.models.llama import RMSNorm

    norm = RMSNorm(64, 1e-5)
    norm.weight.data = randn(64, dtype=torch.float32, seed=4)
    x = randn(3, 64, dtype=torch.float32)
    torch.testing.assert_close(torch_twins.rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "k_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 32)])
def test_rotary_matches_reference(device, dtype, q_heads, k_heads, head_dim):
    positions = torch.tensor([0, 1, 17, 511, 2047])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = (positions[:, None] * inv_freq[None, :]).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    query, key = randn(5, q_heads, head_dim, dtype=dtype), randn(5, k_heads, head_dim, dtype=dtype, seed=3)
    on_device = [t.to(device) for t in (query, key, cos, sin)]
    got_q, got_k = triton_norm_rope.rotary_embedding(*on_device)
    expected_q, expected_k = torch_twins.rotary_embedding(query, key, cos, sin)
    torch.testing.assert_close(got_q.cpu(), expected_q, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(got_k.cpu(), expected_k, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_reference_rotary_is_hfs():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = randn(4, 32, dtype=torch.float32).cos(), randn(4, 32, dtype=torch.float32, seed=1).sin()
    query, key = randn(4, 2, 32, dtype=torch.float32), randn(4, 1, 32, dtype=torch.float32, seed=2)
    got_q, got_k = torch_twins.rotary_embedding(query, key, cos, sin)
    # HF: [batch, heads, T, D] with cos/sin [batch, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
    )
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1))
