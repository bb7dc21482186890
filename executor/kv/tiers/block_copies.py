"""KV blocks' bytes in and out of the pool's tensor, for the tiers' workers: on CUDA on a stream of their own, so
the copies overlap the steps' kernels, each call complete when it returns (the engine thread reads a finished
future as a finished copy)."""

from __future__ import annotations

import contextlib

import torch


class BlockCopies:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [layers, K/V, blocks, ...] (executor/kv/layout.py)
        self.stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' payloads, [n, layers, K/V, ...] in host memory."""
        with self._stream():
            ids = torch.tensor(block_ids, device=self.kv_cache.device)
            payloads = self.kv_cache.movedim(2, 0)[ids].to("cpu")
            self._sync()
        return payloads

    def read(self, block_id: int) -> torch.Tensor:
        """One block's payload, a copy in host memory."""
        view = self.kv_cache[:, :, block_id]
        payload = torch.empty(view.shape, dtype=view.dtype)
        with self._stream():
            payload.copy_(view)
            self._sync()
        return payload

    def write(self, block_id: int, payload: torch.Tensor) -> None:
        """A payload into one block (call done() after the last of a batch)."""
        with self._stream():
            self.kv_cache[:, :, block_id].copy_(payload, non_blocking=self.stream is not None)

    def done(self) -> None:
        self._sync()

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
