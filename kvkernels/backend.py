"""The --attention-backend choice: the kernels a model is built with, for attention over the paged KV cache and
for the per-layer operations around it (rotary embedding, the residual add fused with RMSNorm, SiLU and multiply).

auto picks Triton on CUDA and torch elsewhere; the model's code is the same either way, only these functions
differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvkernels import layer_ops, torch_paged
from kvkernels.cpu_linear import pack_linears, packing_available
from kvkernels.triton_mode import interpreting, triton_available


@dataclass(frozen=True, slots=True)
class Kernels:
    """The functions a model calls for one --attention-backend, and how they ready a built model."""

    name: str
    # attention over the paged KV cache
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    # the per-layer operations
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (rms_norm(x + residual), x + residual): the residual stream's add fused with the norm that follows it
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # [T, 2I] (gate, then up) -> silu(gate) * up
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (device, dtype): build what the kernels build on first use
    build: Callable[[torch.device, torch.dtype], None]
    # every kernel sizes its launch from shapes alone, with no read back to the host: CUDA graphs can hold it
    graph_safe: bool = False
    # (x, out, groups): out += each group's LoRA update of its rows of x (kvkernels/torch_twins.py lora_add)
    lora_add: Callable[..., None] = layer_ops.lora_add

    def prepare(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Ready a built model for serving: the kernels built now rather than at the first request, and its linear
        weights packed once where a packed GEMM serves (float32 on the CPU, kvkernels/cpu_linear.py)."""
        self.build(device, dtype)
        if packing_available(device, dtype):
            pack_linears(model)


# On the CPU in float32 these run as C++ kernels (kvkernels/layer_ops.py, torch_paged.py); elsewhere as torch ops.
TORCH = Kernels(
    "torch",
    torch_paged.paged_attention,
    torch_paged.reshape_and_cache,
    layer_ops.rotary_embedding,
    layer_ops.add_rms_norm,
    layer_ops.silu_and_mul,
    torch_paged.build,
)


def _triton() -> Kernels:
    from kvkernels import triton_attention, triton_cache, triton_lora, triton_norm_rope

    return Kernels(
        "triton",
        triton_attention.paged_attention,
        triton_cache.reshape_and_cache,
        triton_norm_rope.rotary_embedding,
        triton_norm_rope.add_rms_norm,
        layer_ops.silu_and_mul,  # torch's two ops on CUDA; a CUDA graph holds them like any other
        # Triton compiles each kernel at its first launch: the memory-profiling step does it, unless
        # --kv-cache-memory skips that step (then the first requests wait seconds for it)
        lambda device, dtype: None,
        graph_safe=True,
        # sized on the host from the step's groups: adapter steps never run under CUDA graphs
        lora_add=triton_lora.lora_add,
    )


def choose_kernels(choice: str, device: torch.device) -> Kernels:
    """The kernels for --attention-backend; raises ValueError naming the flag when Triton is asked for where it
    cannot run."""
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
