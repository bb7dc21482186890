"""The sampler's reduction over the vocabulary: greedy decoding's argmax. On the CPU in float32 the C++ kernel
(kvkernels/csrc/argmax_cpu.cpp) gives torch's answer in one vectorized pass; elsewhere torch's own argmax."""

from __future__ import annotations

import torch

from kvkernels.layer_ops import cpu_kernels_for


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN counting as the largest), as torch.argmax(dim=-1)."""
    ops = cpu_kernels_for(logits)
    if ops is None or logits.dim() != 2 or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return ops.argmax_rows(logits.contiguous())
