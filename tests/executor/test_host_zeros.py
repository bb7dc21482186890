"""The CPU KV pool's memory: zeros, mapped up front, owned by the tensor."""

import gc
import resource

import torch

from executor.model_runner import host_zeros


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_host_zeros_are_zeros_of_the_shape_and_dtype_and_stay_writable_after_gc() -> None:
    pool = host_zeros((3, 2, 5, 16, 4), torch.float32)
    assert pool.shape == (3, 2, 5, 16, 4) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    gc.collect()  # the mmap behind it lives as long as the tensor
    pool[1, 0, 2] = 7.0
    assert float(pool.sum()) == 7.0 * 16 * 4
    assert host_zeros((0, 8), torch.float16).shape == (0, 8)


def test_host_zeros_pages_are_mapped_before_first_use() -> None:
    pool = host_zeros((64, 1 << 18), torch.float32)  # 64 MiB: 16384 pages of 4 KiB
    before = _minor_faults()
    pool.fill_(1.0)
    assert _minor_faults() - before < 256  # writing every page faulted none of them in
