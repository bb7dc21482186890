"""The CPU GEMM for decode batch sizes (kvkernels/csrc/small_gemm_cpu.cpp) and the PackedLinear that calls it,
against float64 matrix products: every row remainder of its 6-row kernel, widths that are not a multiple of its
16-column panels, biases, strided inputs, one thread and two."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvkernels.backend import TORCH
from kvkernels.cpu_extension import cpu_kernels
from kvkernels.cpu_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels could not be built here")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def _close(got: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    # float32 accumulation over k terms of unit-variance products: errors grow like sqrt(k) ulps
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * k**0.5 * 4)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 16, 33, 130])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (37, 16), (64, 3), (100, 49), (37, 650)])
def test_matches_float64_for_every_row_remainder_and_ragged_widths(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    ops = cpu_kernels()
    packed = ops.pack_gemm_weight(weight)
    assert packed.shape == (-(-n // 16), k, 16)
    _close(ops.small_gemm(x, packed, n, None), _reference(x, weight, None), k)


@pytest.mark.parametrize("threads", [1, 2])
def test_bias_and_a_strided_input(threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        wide = torch.randn(9, 300, generator=gen)
        x = wide[:, 20:148]  # rows 300 floats apart, as the q part of a fused qkv output
        weight, bias = torch.randn(70, 128, generator=gen), torch.randn(70, generator=gen)
        ops = cpu_kernels()
        got = ops.small_gemm(x, ops.pack_gemm_weight(weight), 70, bias)
        _close(got, _reference(x, weight, bias), 128)
    finally:
        torch.set_num_threads(previous)


def test_refuses_shapes_that_do_not_fit() -> None:
    ops = cpu_kernels()
    packed = ops.pack_gemm_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K"):
        ops.small_gemm(torch.randn(3, 9), packed, 20, None)
    with pytest.raises(RuntimeError, match="N does not fit"):
        ops.small_gemm(torch.randn(3, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.small_gemm(torch.randn(3, 8), packed, 20, torch.randn(19))


def test_packed_linear_replaces_nn_linear_in_a_model() -> None:
    gen = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Linear(48, 40), nn.SiLU(), nn.Linear(40, 24, bias=False))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(2, 5, 48, generator=gen)  # leading dimensions kept
    with torch.no_grad():
        expected = model.double()(x.double())
        model.float()
        assert pack_linears(model) == 2
        assert all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
        got = model(x)
    assert got.shape == (2, 5, 24)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_the_kernels_prepare_pack_a_float32_cpu_models_linears_and_nothing_else() -> None:
    cpu = torch.device("cpu")
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    TORCH.prepare(model, cpu, torch.float32)
    assert all(isinstance(m, PackedLinear) for m in model)
    model = nn.Sequential(nn.Linear(8, 4)).bfloat16()
    TORCH.prepare(model, cpu, torch.bfloat16)  # no packed GEMM serves bf16
    assert isinstance(model[0], nn.Linear)
