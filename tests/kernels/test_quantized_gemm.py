"""The CPU GEMM over quantized weights (kvkernels/csrc/quantized_gemm_cpu.cpp) and QuantizedLinear around it, against
float64 products of the dequantized weights: every row remainder of its 6-row kernel and the many-row path,
widths that are not a multiple of its 16-column panels, a scale per row or per group of 32 or 128 inputs, 8 and
4 bits (signed and unsigned), with and without offsets, scales and offsets held as float32 or (where they are
float16 values, as GGUF's are) as float16; and the torch fallback where the kernels are off.

Every input path: float32 activations, and activations quantized to int8 in blocks of 32 (int8_dot_kernel.h, where
the CPU has AVX-512 VNNI) in one plane (int8) or two (int16: each block's rounding error as a second int8), the
quantized ones against float64 products of the same quantized activations (kvkernels/torch_twins.py) and within
the rounding of that quantization of the exact product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvkernels.backend import TORCH
from kvkernels.cpu_extension import cpu_kernels
from kvkernels.quantized import PanelWeight, QuantizedLinear, QuantizedWeight, quantize_int8
from kvkernels.torch_twins import int8_activations
from kvkernels.weight_quantization import TiedEmbedding, quantize_linears

needs_kernels = pytest.mark.skipif(
    cpu_kernels() is None, reason="the C++ CPU kernels could not be built here"
)


ROWS = [*range(1, 14), 64, 256]
INT8_DOT = cpu_kernels() is not None and cpu_kernels().int8_dot_available()
needs_int8_dot = pytest.mark.skipif(not INT8_DOT, reason="int8 activations need AVX-512 VNNI and VBMI")


def _weight(
    n: int,
    k: int,
    group: int | None,
    bits: int,
    offsets: bool,
    signed: bool,
    seed: int,
    half: bool = False,
) -> QuantizedWeight:
    """Random integers with scales (and offsets), float16 values where half (as a GGUF block's)."""
    gen = torch.Generator().manual_seed(seed)
    group = k if group is None else group
    low, high = (-128, 128) if bits == 8 else ((-8, 8) if signed else (0, 16))
    values = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    shifts = torch.randn(n, k // group, generator=gen) * 0.05 if offsets else None
    if half:
        scales = scales.half().float()
        shifts = None if shifts is None else shifts.half().float()
    return QuantizedWeight(values, scales, shifts, group, bits)


def _close(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    expected = x.double() @ weight.dequantize().double().T
    if bias is not None:
        expected += bias.double()
    assert got.dtype == torch.float32
    # float32 accumulation of k products, each weight rounded once: a few ulps of the largest partial sums
    scale = (x.double().abs() @ weight.dequantize().double().abs().T).amax()
    torch.testing.assert_close(
        got.double(), expected, rtol=0, atol=float(scale) * 4e-7 * weight.shape[1] ** 0.5
    )


CASES = [
    (8, None, False, True),
    (8, 32, False, True),
    (8, 128, True, True),
    (4, None, False, True),  # Q4_0's form: signed values, no offsets
    (4, 32, False, True),
    (4, 32, True, False),  # Q4_1's form: unsigned values and offsets
    (4, 128, True, False),
    (8, 32, True, True),
]


@needs_kernels
@pytest.mark.parametrize(
    "planes",
    [0, pytest.param(1, marks=needs_int8_dot), pytest.param(2, marks=needs_int8_dot)],
    ids=["float32-activations", "int8-activations", "int16-activations"],
)
@pytest.mark.parametrize(
    ("bits", "group", "offsets", "signed", "half"),
    # float32 scales for every case; float16 ones (GGUF's) for the block forms GGUF has: Q8_0, Q4_0, Q4_1
    [(*case, False) for case in CASES]
    + [(8, 32, False, True, True), (4, 32, False, True, True), (4, 32, True, False, True)],
)
def test_matches_float64_for_every_row_remainder_group_and_width(
    bits, group, offsets, signed, half, planes
) -> None:
    """Float32 activations against float64 of the same; quantized ones against float64 of the same quantized
    activations, and within that quantization's rounding of the exact product: half a step per input for int8,
    half a 254th of one for int16."""
    ops = cpu_kernels()
    for n in (50, 32):
        weight = _weight(n, 256, group, bits, offsets, signed, seed=n + bits, half=half)
        panels = PanelWeight.pack(weight, ops, planes)
        assert panels.values.shape == (-(-n // 16), 256, 16 if bits == 8 else 8)
        assert panels.scales.dtype == (torch.float16 if half else torch.float32)
        assert panels.activation_planes == planes
        unpacked = panels.unpack()
        assert torch.equal(unpacked.scales, weight.scales) and unpacked.scales.dtype == torch.float32
        bias = torch.randn(n) if n == 50 else None
        for rows in ROWS:
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            got = ops.quantized_gemm(
                x, panels.values, panels.scales, panels.offsets, n, bits, panels.zero_point, bias, planes
            )
            if planes == 0:
                _close(got, x, weight, bias)
                continue
            _close(got, int8_activations(x, planes).float(), weight, bias)
            steps = x.view(rows, -1, 32).abs().amax(-1).double().repeat_interleave(32, dim=1) / 127.0
            if planes == 2:
                steps /= 254.0
            bound = (steps / 2) @ weight.dequantize().double().abs().T
            exact = x.double() @ weight.dequantize().double().T + (0 if bias is None else bias.double())
            # the float32 accumulation's few ulps on top (what _close allows), which int16's bound is near
            rounding = (x.double().abs() @ weight.dequantize().double().abs().T) * 4e-7 * 16
            assert bool(((got.double() - exact).abs() <= bound * 1.001 + rounding + 1e-5).all())


@needs_int8_dot
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("group", [64, 32])  # the general kernel, and the one for groups of one block
def test_int8_activations_give_a_row_the_same_result_beside_any_rows(planes, group) -> None:
    """A row's activations are quantized alone and its sums kept apart, so its output does not depend on the batch
    it runs in: a request's tokens do not change with the load."""
    ops = cpu_kernels()
    weight = _weight(70, 192, group, 4, True, False, seed=5)
    p = PanelWeight.pack(weight, ops, planes)
    x = (
        torch.randn(23, 192, generator=torch.Generator().manual_seed(2))
        * torch.linspace(0.1, 10, 23)[:, None]
    )
    whole = ops.quantized_gemm(x, p.values, p.scales, p.offsets, 70, 4, p.zero_point, None, planes)
    for r in (0, 6, 22):
        alone = ops.quantized_gemm(
            x[r : r + 1], p.values, p.scales, p.offsets, 70, 4, p.zero_point, None, planes
        )
        assert torch.equal(alone[0], whole[r])


def test_int16_activations_hold_each_input_to_a_254th_of_int8s_step() -> None:
    """The twin's second plane: every input within half a 254th of its block's int8 step, where int8 alone is
    within half a step; a block of zeros stays zeros."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 96)
    x[1, 32:64] = 0.0
    steps = x.view(5, 3, 32).abs().amax(-1).double().repeat_interleave(32, dim=1) / 127.0
    one, two = (int8_activations(x, planes) for planes in (1, 2))
    assert bool(((one - x.double()).abs() <= steps / 2 * 1.0001).all())
    assert bool(((two - x.double()).abs() <= steps / 2 / 254 * 1.01).all())
    assert ((two - x.double()).abs().mean() < (one - x.double()).abs().mean() / 100).item()
    assert not two[1, 32:64].any()


@needs_kernels
def test_int8_activations_are_refused_where_they_cannot_run() -> None:
    ops = cpu_kernels()
    weight = _weight(20, 48, 16, 8, False, True, seed=2)  # groups of 16: not whole blocks of 32
    p = PanelWeight.pack(weight, ops, 2)
    assert p.activation_planes == 0
    match = "whole blocks of 32" if ops.int8_dot_available() else "VNNI"
    for planes in (1, 2):
        with pytest.raises(RuntimeError, match=match):
            ops.quantized_gemm(torch.randn(2, 48), p.values, p.scales, None, 20, 8, 0, None, planes)
    with pytest.raises(RuntimeError, match="activation_planes 0"):
        ops.quantized_gemm(torch.randn(2, 48), p.values, p.scales, None, 20, 8, 0, None, 3)


@needs_kernels
def test_panels_unpack_to_the_weight_and_give_any_rows() -> None:
    ops = cpu_kernels()
    for bits, group, offsets, signed in CASES:
        weight = _weight(37, 64, group and min(group, 32), bits, offsets, signed, seed=bits)
        panels = PanelWeight.pack(weight, ops)
        back = panels.unpack()
        assert torch.equal(back.values, weight.values) and torch.equal(back.scales, weight.scales)
        ids = torch.tensor([36, 0, 17, 17, 8])
        assert torch.equal(panels.rows(ids).dequantize(), weight.dequantize()[ids])


@needs_kernels
def test_a_strided_input_and_two_threads() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = quantize_int8(torch.randn(70, 128), group_size=64)
        layer = QuantizedLinear(weight, torch.randn(70))
        layer.pack(cpu_kernels())
        wide = torch.randn(9, 300)
        x = wide[:, 20:148]  # rows 300 floats apart
        _close(layer(x), _as_multiplied(x, layer), weight, layer.bias)
    finally:
        torch.set_num_threads(previous)


@needs_int8_dot
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_splitting_a_row_block_give_every_panel_once(threads, planes) -> None:
    """At up to 6 rows each thread takes its own range of panels and then the rest of the others' from their backs
    (stealing_parallel.h): over any number of panels, ranges of a chunk or less, more threads than cores, the
    result is one thread's bit for bit, so no panel is left out or done twice."""
    ops = cpu_kernels()
    previous = torch.get_num_threads()
    for bits, k in ((8, 256), (4, 512), (8, 2048)):  # chunks of 8, 8 and 1 panels
        weight = _weight(16 * 41, k, 32, bits, bits == 4, bits == 8, seed=k)
        p = PanelWeight.pack(weight, ops, planes)
        for rows in (1, 6):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            for n in (1, 16, 17, 130, 16 * 41):
                panels = -(-n // 16)
                args = (
                    x,
                    p.values[:panels],
                    p.scales[:panels],
                    None if p.offsets is None else p.offsets[:panels],
                    n,
                    bits,
                    p.zero_point,
                    None,
                    planes,
                )
                try:
                    torch.set_num_threads(1)
                    alone = ops.quantized_gemm(*args)
                    torch.set_num_threads(threads)
                    for _ in range(3):
                        assert torch.equal(ops.quantized_gemm(*args), alone), (bits, k, rows, n)
                finally:
                    torch.set_num_threads(previous)


@needs_kernels
def test_refuses_what_does_not_fit_and_takes_no_rows() -> None:
    ops = cpu_kernels()
    weight = _weight(20, 64, 32, 4, False, True, seed=1)
    p = PanelWeight.pack(weight, ops)
    assert ops.quantized_gemm(torch.randn(0, 64), p.values, p.scales, None, 20, 4, 8, None, 0).shape == (
        0,
        20,
    )
    with pytest.raises(RuntimeError, match="0..15"):
        ops.pack_quantized_weight(weight.values, weight.scales, None, 4, 0)  # signed without a zero point
    with pytest.raises(RuntimeError, match="K"):
        ops.quantized_gemm(torch.randn(3, 63), p.values, p.scales, None, 20, 4, 8, None, 0)
    with pytest.raises(RuntimeError, match="N does not fit"):
        ops.quantized_gemm(torch.randn(3, 64), p.values, p.scales, None, 40, 4, 8, None, 0)


def _as_multiplied(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """x as the packed layer's GEMM takes it: quantized to int8 blocks where it multiplies integers."""
    if layer._panels is None or layer._panels.activation_planes == 0:
        return x
    rows = x.reshape(-1, x.shape[-1])
    return int8_activations(rows.contiguous(), layer._panels.activation_planes).float().view(x.shape)


def test_quantized_linear_packed_and_by_torch_agree_and_pack_holds_fewer_bytes(monkeypatch) -> None:
    """kernels.prepare packs a model's QuantizedLinear where the kernels serve; with KVSERVE_CPU_KERNELS=0 the
    layer stays as its QuantizedWeight and torch dequantizes it."""
    gen = torch.Generator().manual_seed(3)
    float_weight = torch.randn(96, 160, generator=gen)
    x = torch.randn(2, 7, 160, generator=gen)
    expected = x.double() @ quantize_int8(float_weight).dequantize().double().T
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    off = nn.Sequential(QuantizedLinear(quantize_int8(float_weight)))
    TORCH.prepare(off, torch.device("cpu"), torch.float32)
    assert off[0]._panels is None
    torch.testing.assert_close(off(x).double(), expected, rtol=0, atol=1e-4)
    if cpu_kernels() is None:
        return
    monkeypatch.delenv("KVSERVE_CPU_KERNELS")
    on = nn.Sequential(QuantizedLinear(quantize_int8(float_weight)))
    TORCH.prepare(on, torch.device("cpu"), torch.float32)
    layer = on[0]
    assert layer._panels is not None and layer._weight is None  # the unpacked values are gone
    assert layer._panels.activation_planes == int(cpu_kernels().int8_dot_available())
    expected = _as_multiplied(x, layer).double() @ quantize_int8(float_weight).dequantize().double().T
    torch.testing.assert_close(on(x).double(), expected, rtol=0, atol=1e-4)
    assert layer.nbytes == 96 * 160 + 96 * 4 < float_weight.nbytes / 3.9
    assert torch.equal(layer.weight_q.values, quantize_int8(float_weight).values)


def test_a_tied_embedding_reads_the_quantized_head() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(40, 32)
            self.head = nn.Linear(32, 40, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert quantize_linears(model, "int8", group_size=16) == 1
    assert isinstance(model.embed, TiedEmbedding) and isinstance(model.head, QuantizedLinear)
    TORCH.prepare(model, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[3, 39], [0, 3]])
    rows = model.embed(ids)
    assert rows.shape == (2, 2, 32) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, model.head.weight_q.dequantize()[ids])
    with pytest.raises(ValueError, match="--quantization-group-size 24 does not divide"):
        quantize_linears(Tied(), "int8", group_size=24)
