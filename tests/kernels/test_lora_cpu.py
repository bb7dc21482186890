"""The CPU LoRA kernel (kvkernels/csrc/lora_cpu.cpp) against float64 products and its torch twin: ragged widths
and row counts, groups of no rows, a row's bits the same in any batch and on one thread or two, and bad shapes
refused with the reason."""

from __future__ import annotations

import pytest
import torch

from kvkernels import layer_ops, torch_twins
from kvkernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels could not be built here")


def _adapter(gen: torch.Generator, k: int, n: int, rank: int, parts: int):
    """A [parts x rank, k] and `parts` parts spread over n output columns, the last one ragged."""
    a = torch.randn(parts * rank, k, generator=gen)
    width = n // parts
    laid = []
    for p in range(parts):
        start, end = p * width, (p + 1) * width if p < parts - 1 else n - 1
        laid.append((start, end, torch.randn(rank, end - start, generator=gen), p * rank))
    return a, laid


def _groups(gen: torch.Generator, rows: int, k: int, n: int, rank: int, cuts: list[int]):
    bounds = [0, *cuts, rows]
    return [
        (slice(first, last), *_adapter(gen, k, n, rank, 3))
        for first, last in zip(bounds, bounds[1:], strict=False)
    ]


def _reference(x: torch.Tensor, out: torch.Tensor, groups) -> torch.Tensor:
    expected = out.double().clone()
    for rows, a, parts in groups:
        shrunk = x[rows].double() @ a.double().T
        for start, end, bt, first in parts:
            expected[rows, start:end] += shrunk[:, first : first + bt.shape[0]] @ bt.double()
    return expected


@pytest.mark.parametrize(
    ("rows", "cuts"), [(1, []), (2, [1]), (7, [0, 3, 3]), (16, [2, 4, 6, 8, 10, 12, 14]), (130, [61])]
)
@pytest.mark.parametrize(("k", "n", "rank"), [(576, 960, 16), (37, 50, 5), (64, 3 * 17, 8)])
def test_matches_float64_for_ragged_rows_widths_and_empty_groups(rows, cuts, k, n, rank):
    gen = torch.Generator().manual_seed(rows * 100 + k)
    x, out = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
    groups = _groups(gen, rows, k, n, rank, cuts)
    expected = _reference(x, out, groups)
    layer_ops.lora_add(x, out, groups)
    # float32 sums over k then rank terms of unit-variance products
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * (k * rank) ** 0.5 * 8)


def test_the_torch_twin_takes_gathered_rows_and_agrees():
    gen = torch.Generator().manual_seed(3)
    x, out = torch.randn(9, 40, generator=gen), torch.randn(9, 33, generator=gen)
    a, parts = _adapter(gen, 40, 33, 4, 2)
    rows = torch.tensor([0, 4, 8])
    expected = _reference(x, out, [(rows, a, parts)])
    torch_twins.lora_add(x, out, [(rows, a, parts)])
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_batch_around_it(threads):
    """Alone, in a group of 130 rows or among other adapters' groups: the same bits, as the decoder stack and
    the Python loop must give one row whichever ran its step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(130, 576, generator=gen)
        a, parts = _adapter(gen, 576, 960, 16, 3)
        others = _groups(gen, 130, 576, 960, 16, [40, 90])
        ops = cpu_kernels()
        batch = torch.zeros(130, 960)
        ops.lora_add_(x, batch, [(0, 130, a, parts)])
        mixed = torch.zeros(130, 960)
        ops.lora_add_(
            x, mixed, [(40, 90, a, parts), *((g.start, g.stop, oa, op) for g, oa, op in others[::2])]
        )
        for row in (0, 45, 129):
            alone = torch.zeros(1, 960)
            ops.lora_add_(x[row : row + 1], alone, [(0, 1, a, parts)])
            assert torch.equal(alone[0], batch[row])
        assert torch.equal(mixed[40:90], batch[40:90])
    finally:
        torch.set_num_threads(previous)


def test_bad_shapes_are_refused_with_the_reason():
    ops = cpu_kernels()
    x, out = torch.randn(4, 32), torch.zeros(4, 20)
    a, bt = torch.randn(8, 32), torch.randn(8, 10)
    with pytest.raises(RuntimeError, match="A of 31 inputs for x's 32"):
        ops.lora_add_(x, out, [(0, 4, torch.randn(8, 31), [(0, 10, bt, 0)])])
    with pytest.raises(RuntimeError, match=r"rows \[2, 5\) of 4"):
        ops.lora_add_(x, out, [(2, 5, a, [(0, 10, bt, 0)])])
    with pytest.raises(RuntimeError, match="does not fit 20 columns"):
        ops.lora_add_(x, out, [(0, 4, a, [(15, 25, bt, 0)])])
    with pytest.raises(RuntimeError, match=r"B\^T \[rank, 9\]"):
        ops.lora_add_(x, out, [(0, 4, a, [(0, 9, bt, 0)])])
    assert torch.equal(out, torch.zeros(4, 20))  # nothing half-written
