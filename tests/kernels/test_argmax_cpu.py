"""The C++ argmax over rows of logits gives torch.argmax's index exactly: the first of tied maxima, the first NaN
where there is one, 0 for a row of -inf, at every row length's remainder against the vector width."""

from __future__ import annotations

import pytest
import torch

from kvkernels.cpu_extension import cpu_kernels
from kvkernels.sampling_ops import argmax_rows

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels are not built here")


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 31, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_random_rows_give_torchs_index(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_nans_and_infinities_give_torchs_index():
    vocab = 50
    cases = torch.randn(9, vocab, generator=torch.Generator().manual_seed(1))
    cases[0, [5, 17, 40]] = 9.0  # tied maxima: the first
    cases[1, [3, 11]] = float("nan")  # NaN counts as the largest: the first NaN
    cases[1, 2] = float("inf")
    cases[2] = float("-inf")  # nothing larger than the first
    cases[3, 49] = float("inf")  # in the tail past the last full vector
    cases[4] = 0.0
    cases[4, 30] = -0.0  # -0 equals 0: still the first
    cases[5, 48] = float("nan")  # a NaN in the tail
    cases[6, [0, 8]] = float("inf")  # ties in different lanes of different vectors
    cases[7, [9, 1]] = 100.0  # the lower index sits in a later lane of an earlier vector
    cases[8, 0] = 1e30  # the very first position
    assert torch.equal(ops.argmax_rows(cases), cases.argmax(dim=-1)), (
        ops.argmax_rows(cases),
        cases.argmax(-1),
    )


def test_the_samplers_argmax_takes_views_and_other_dtypes_as_torch_does():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    view = logits[:, 10:90]  # not contiguous
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits.to(torch.bfloat16)), logits.to(torch.bfloat16).argmax(dim=-1))
    assert torch.equal(argmax_rows(logits[0]), logits[0].argmax(dim=-1))  # one row, 1-D: torch's own


def test_bad_shapes_are_refused_by_the_kernel():
    with pytest.raises(RuntimeError, match="argmax_rows: contiguous float32"):
        ops.argmax_rows(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="an empty vocabulary"):
        ops.argmax_rows(torch.zeros(3, 0))
