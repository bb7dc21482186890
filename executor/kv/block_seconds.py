"""KV block-seconds: how many KV blocks a request held, times for how long, for its tenant's bill.

A Riemann sum at step granularity: each step, just after the scheduler has allocated (when a step's blocks are
what the forward pass holds), every running request is charged the blocks it held at the previous charge for the
time since, then its blocks are counted again. A request that ends is charged up to its end. The count is one
len() per running request per step; no block is looked at.

Parallel sampling (n > 1): the choices share their prompt's full blocks (executor/kv/cache_manager.py `fork`), and
full blocks are never written again, so those stay shared. The group pays for them once: one running choice is
charged them, every choice its blocks past them (the partly filled prompt block each copies on its first write,
and its own output). A choice preempted and recomputed with prefix caching off holds its prompt blocks privately,
and those copies go uncharged. Blocks shared across requests through the prefix cache count for each request that
holds them: each holds them as long as it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from executor.kv.cache_manager import KVCacheManager
from executor.request import Request


class KVBlockSeconds:
    def __init__(self, kv: KVCacheManager, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.kv = kv
        self.clock = clock
        self.held: dict[Request, int] = {}  # blocks each running request was charged at the last charge
        self.charged_ns = clock()

    def charge(self, running: list[Request]) -> None:
        """Charge what each request held since the last charge, then count what it holds now."""
        now = self.clock()
        seconds = (now - self.charged_ns) / 1e9
        for request, blocks in self.held.items():
            request.kv_block_seconds += blocks * seconds
        self.charged_ns = now
        held: dict[Request, int] = {}
        prompts_paid: set[str] = set()  # groups (n > 1) whose shared prompt blocks a choice was charged
        for request in running:
            blocks = self.kv.num_blocks(request)
            if request.params.n > 1:
                shared = request.num_prompt_tokens // self.kv.block_size
                if request.group_id in prompts_paid:
                    blocks = max(0, blocks - shared)
                else:
                    prompts_paid.add(request.group_id)
            held[request] = blocks
        self.held = held

    def settle(self, request: Request) -> None:
        """A request that ends: charge it up to now, and no more."""
        blocks = self.held.pop(request, 0)
        if blocks:
            request.kv_block_seconds += blocks * (self.clock() - self.charged_ns) / 1e9
