"""Attention kernels over the paged KV cache; kernels.reference holds the torch twins that define them.

paged_attention / reshape_and_cache here are the torch path (CPU, or CUDA without Triton); the Triton kernels
live in kernels/triton_*.py, and kernels.backend picks between the two for --attention-backend.
"""

from kernels.torch_paged import paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
