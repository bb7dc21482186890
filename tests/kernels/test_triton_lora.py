"""The Triton LoRA kernels (kvkernels/triton_lora.py) against their torch twin and float64 products: ragged groups
of rows, gathered rows, several adapters of different ranks and parts in one call, columns and inputs that are no
multiple of a tile, a shrink split over the inputs, and a row's bits the same in any batch.

As in test_triton_attention: Triton's interpreter on CPU tensors where no CUDA device exists, compiled on CUDA
otherwise. The interpreter is slow: the shapes are small."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())
pytest.importorskip("triton")

from kvkernels import backend, torch_twins, triton_lora  # noqa: E402
from tests.kernels.test_triton_attention import DEVICES  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# against float64, on updates of a few units: fp32 differs in summation order; fp16 and bf16 round the shrunk
# rows, the update and the sum (the twin as well, so it sits as far from float64 as the kernels do)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}


def _adapter(gen: torch.Generator, inputs: int, columns: int, rank: int, parts: int, dtype: torch.dtype):
    """A [parts x rank, inputs] and its parts over `columns` output columns, each part's width ragged; B scaled
    so the shrunk rows and the update stay a few units."""
    a = torch.randn(parts * rank, inputs, generator=gen) / inputs**0.5
    bounds = [round(columns * p / parts) - (p % 2) for p in range(parts)] + [columns - 1]
    laid = [
        (start, end, torch.randn(rank, end - start, generator=gen) / rank**0.5, p * rank)
        for p, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]
    return a.to(dtype), [(start, end, bt.to(dtype), first) for start, end, bt, first in laid]


def _reference(x: torch.Tensor, out: torch.Tensor, groups) -> torch.Tensor:
    """The twin's update in float64."""
    expected = out.double().clone()
    in_float64 = [
        (rows, a.double(), [(start, end, bt.double(), first) for start, end, bt, first in parts])
        for rows, a, parts in groups
    ]
    torch_twins.lora_add(x.double(), expected, in_float64)
    return expected


def _on(device: str, groups):
    return [
        (
            rows if isinstance(rows, slice) else rows.to(device),
            a.to(device),
            [(start, end, bt.to(device), first) for start, end, bt, first in parts],
        )
        for rows, a, parts in groups
    ]


def _mixed_step(dtype: torch.dtype, inputs: int = 96, columns: int = 150):
    """48 rows: groups of 1, 2, 33 and 7 gathered rows under four adapters of ranks 8 and 16 and of 1 to 4 parts,
    the rest the base model's."""
    gen = torch.Generator().manual_seed(len(str(dtype)))
    x = torch.randn(48, inputs, generator=gen).to(dtype)
    out = torch.randn(48, columns, generator=gen).to(dtype)
    gathered = torch.tensor([3, 5, 6, 40, 41, 44, 47])
    groups = [
        (slice(0, 1), *_adapter(gen, inputs, columns, 8, 1, dtype)),
        (slice(1, 3), *_adapter(gen, inputs, columns, 16, 2, dtype)),
        (gathered, *_adapter(gen, inputs, columns, 8, 3, dtype)),
        (slice(7, 40), *_adapter(gen, inputs, columns, 16, 4, dtype)),
    ]
    return x, out, groups


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_matches_the_twin_and_float64(device, dtype):
    x, out, groups = _mixed_step(dtype)
    expected = _reference(x, out, groups)
    twin = out.clone()
    torch_twins.lora_add(x, twin, groups)
    got = out.to(device)
    triton_lora.lora_add(x.to(device), got, _on(device, groups))
    got = got.cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=TOLERANCE[dtype])
    torch.testing.assert_close(got.double(), twin.double(), rtol=0, atol=TOLERANCE[dtype])
    # the base model's rows and the columns between parts are left as they were
    untouched = torch.ones_like(out, dtype=torch.bool)
    for rows, _, parts in groups:
        for start, end, _, _ in parts:
            untouched[rows, start:end] = False
    assert torch.equal(got[untouched], out[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_the_shrink_split_over_many_inputs(device):
    """Inputs over triton_lora.SPLIT_K and no multiple of its tile: the partial sums all reach the update."""
    inputs = 2 * triton_lora.SPLIT_K + 37
    gen = torch.Generator().manual_seed(5)
    x, out = torch.randn(9, inputs, generator=gen), torch.randn(9, 70, generator=gen)
    groups = [
        (slice(0, 2), *_adapter(gen, inputs, 70, 16, 2, torch.float32)),
        (slice(4, 9), *_adapter(gen, inputs, 70, 8, 1, torch.float32)),
    ]
    expected = _reference(x, out, groups)
    got = out.to(device)
    triton_lora.lora_add(x.to(device), got, _on(device, groups))
    torch.testing.assert_close(got.cpu().double(), expected, rtol=0, atol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_bits_do_not_depend_on_the_batch_around_it(device):
    """Alone or among 33 rows and other adapters' groups: the same bits, so a request's tokens do not change
    with what it was batched with."""
    x, out, groups = _mixed_step(torch.float32)
    batch = out.to(device)
    triton_lora.lora_add(x.to(device), batch, _on(device, groups))
    rows, a, parts = groups[3]
    alone = out[20:21].to(device)
    triton_lora.lora_add(x[20:21].to(device), alone, _on(device, [(slice(0, 1), a, parts)]))
    assert torch.equal(alone.cpu(), batch[20:21].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_groups_of_no_rows_or_no_columns_add_nothing(device):
    gen = torch.Generator().manual_seed(2)
    x, out = torch.randn(4, 32, generator=gen).to(device), torch.randn(4, 20, generator=gen).to(device)
    a, parts = _adapter(gen, 32, 20, 8, 2, torch.float32)
    before = out.clone()
    triton_lora.lora_add(
        x, out, _on(device, [(slice(2, 2), a, parts), (torch.tensor([], dtype=torch.int64), a, parts)])
    )
    triton_lora.lora_add(x, out, _on(device, [(slice(0, 4), a, [(5, 5, parts[0][2][:, :0], 0)])]))
    assert torch.equal(out, before)


def test_bad_shapes_are_refused_with_the_reason():
    gen = torch.Generator().manual_seed(3)
    x, out = torch.randn(4, 32, generator=gen), torch.randn(4, 20, generator=gen)
    a, parts = _adapter(gen, 32, 20, 8, 2, torch.float32)
    device = "cuda" if not INTERPRETING else "cpu"
    x, out, a = x.to(device), out.to(device), a.to(device)
    parts = [(start, end, bt.to(device), first) for start, end, bt, first in parts]
    with pytest.raises(ValueError, match="A"):
        triton_lora.lora_add(x, out, [(slice(0, 4), a[:, :31], parts)])
    with pytest.raises(ValueError, match="rows 2:5"):
        triton_lora.lora_add(x, out, [(slice(2, 5), a, parts)])
    with pytest.raises(ValueError, match="columns 15:25"):
        triton_lora.lora_add(x, out, [(slice(0, 4), a, [(15, 25, parts[0][2], 0)])])
    with pytest.raises(ValueError, match="rows of A 12:20"):
        triton_lora.lora_add(x, out, [(slice(0, 4), a, [(0, parts[0][1], parts[0][2], 12)])])
    with pytest.raises(ValueError, match="dtype"):
        triton_lora.lora_add(x, out, [(slice(0, 4), a.half(), parts)])


def test_the_triton_backend_runs_lora_in_these_kernels():
    assert backend._triton().lora_add is triton_lora.lora_add
