"""The --attention-backend choice: which pair of paged-attention / cache-write functions the model calls.

auto picks Triton on CUDA and torch elsewhere; the engine code path is the same either way, only these two
functions differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference, torch_paged
from kernels.triton_mode import interpreting, triton_available


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]


# the rotary twin is batched torch already (fp32 math, one rounding: in fp32 the ops HF does)
TORCH = AttentionBackend(
    "torch", torch_paged.paged_attention, torch_paged.reshape_and_cache, reference.rotary_embedding
)


def _triton() -> AttentionBackend:
    from kernels import triton_attention, triton_cache, triton_norm_rope

    return AttentionBackend(
        "triton",
        triton_attention.paged_attention,
        triton_cache.reshape_and_cache,
        triton_norm_rope.rotary_embedding,
    )


def choose_attention_backend(choice: str, device: torch.device) -> AttentionBackend:
    """Raises ValueError naming the flag when Triton is asked for where it cannot run."""
    if choice == "auto":
        # the interpreter is for tests: auto never picks it
        choice = "triton" if device.type == "cuda" and triton_available() and not interpreting() else "torch"
    if choice == "torch":
        return TORCH
    if choice != "triton":
        raise ValueError(f"--attention-backend must be auto, torch or triton, got {choice!r}")
    if not triton_available():
        raise ValueError(
            "--attention-backend triton: the triton package is not installed (pip install triton)"
        )
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"--attention-backend triton: Triton kernels run on CUDA devices, not {device.type}; use "
            "--attention-backend torch (or auto), or TRITON_INTERPRET=1 to run them slowly in Triton's "
            "interpreter for testing"
        )
    return _triton()
