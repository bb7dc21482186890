"""What a step hands out: each request's new tokens and the step's events; and the snapshot of the engine's numbers.

The snapshot's names are the ones published: its routing fields are the executor's load in Redis
(EngineStats.load), its counters and gauges the stats hash behind /metrics (shared/executor_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.sampling.sampler import TokenLogprobs


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int
    num_accepted_tokens: int = 0  # proposals of this request the target has accepted so far
    error: str | None = None  # refused after it was queued (its grammar failed to compile): the message
    error_code: int = 400  # 400 when the spec was at fault, 500 when the engine was
    # params.prompt_logprobs: every prompt token's but the first (which has none), with its first new token
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # the choice (parallel sampling, n > 1); request_id is the whole group's
    group_finished: bool = True  # no choice of the group runs any more: its last output
    # of num_cached_tokens, those a KV tier loaded or a peer's pull brought, by source (Request.cached_from)
    cached_from: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's numbers at one moment: cheap to take every step (no block table is walked)."""

    running: int
    waiting: int  # in the waiting queue, or waiting for their grammar (they will need their prefill too)
    compiling: int  # of waiting: for their grammar, outside the waiting queue's places
    waiting_max_tenant: int  # the most places of the waiting queue one tenant holds
    prefill_tokens: int  # prompt tokens still to prefill: the work a new request waits behind
    queue_full: bool  # every tenant's places in the waiting queue taken
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    # cumulative since start
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    block_hash_mismatches: int  # requests whose gateway hashed their prompt otherwise
    # building and applying token masks (bench/offline/structured_outputs.py)
    structured_output_mask_seconds: float
    # the KV tiers below the pool (executor/kv/tiers/): prompt tokens not computed by where their KV came from
    # (the pool's are the prefix cache's hits less the others), bytes moved, and the tiers' blocks now
    kv_cached_tokens_host: int = 0
    kv_cached_tokens_disk: int = 0
    kv_cached_tokens_peer: int = 0
    kv_offloaded_bytes_host: int = 0
    kv_offloaded_bytes_disk: int = 0
    kv_loaded_bytes_host: int = 0
    kv_loaded_bytes_disk: int = 0
    kv_pulled_bytes: int = 0
    kv_pulls: int = 0
    kv_pulls_failed: int = 0
    kv_disk_files_rejected: int = 0
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_disk_blocks_used: int = 0
    kv_disk_blocks_total: int = 0
    kv_blocks_filled: int = 0  # holding KV, in use or cached: what a new block may evict
    # LoRA adapters (executor/lora/), by name, comma-separated: those running requests use (a step's slots), and
    # those host memory holds; None where the engine serves none
    lora_running: str | None = None
    lora_held: str | None = None

    @property
    def kv_cached_tokens_pool(self) -> int:
        return (
            self.prefix_cache_hit_tokens
            - self.kv_cached_tokens_host
            - self.kv_cached_tokens_disk
            - self.kv_cached_tokens_peer
        )

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    def load(self) -> dict[str, float | str]:
        """What routing needs, published after each step that changes it (the executor's load in Redis)."""
        adapters = (
            {} if self.lora_held is None else {"lora_running": self.lora_running, "lora_held": self.lora_held}
        )
        return adapters | {
            "running": self.running,
            "waiting": self.waiting,
            "compiling": self.compiling,
            "waiting_max_tenant": self.waiting_max_tenant,
            "prefill_tokens": self.prefill_tokens,
            "kv_usage": self.kv_usage,
            "kv_filled": self.kv_blocks_filled / self.kv_blocks_total,
            "queue_full": int(self.queue_full),
        }


@dataclass(slots=True)
class StepResult:
    """One step: its outputs and its events. The engine's numbers are Engine.stats(), taken when they are
    published (aborts after the step change them)."""

    outputs: list[StepOutput] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)  # seconds each request first scheduled had waited
    cached: list[bytes] = field(default_factory=list)  # block hashes newly in the prefix cache, netted
    evicted: list[bytes] = field(default_factory=list)  # and those no longer in it
    # the same for each KV tier below the pool: tier name (shared.redis_keys.TIERS) -> (added, removed), netted
    tier_events: dict[str, tuple[list[bytes], list[bytes]]] = field(default_factory=dict)
    pull_times: list[float] = field(default_factory=list)  # seconds each pull from a peer settled since took
