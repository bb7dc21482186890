"""Attention kernels over the paged KV cache; kernels.reference holds the torch twins that define them."""

from kernels.torch_paged import paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
