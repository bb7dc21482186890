"""A request's own state, as the scheduler and KV cache see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from executor.sampling.sampling_state import SamplingState
from shared.block_hash import adapter_salt
from shared.sampling_params import SamplingParams
from shared.tenant import ANONYMOUS_TENANT, Tenant

if TYPE_CHECKING:
    from executor.lora.adapter_files import LoRAAdapter
    from executor.lora.adapters import KnownAdapter
    from executor.sampling.sampler import TokenLogprobs
    from executor.structured.grammar_masks import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # whose request it is (shared/tenant.py): its fair share, waiting places, KV share and cache salt go by it
    tenant: Tenant = ANONYMOUS_TENANT
    priority: int = 0  # within its tenant, lower first (executor/scheduling/waiting_queue.py)
    # the LoRA adapter it runs under (executor/lora/; None: the base model), and its weights once loaded
    lora: KnownAdapter | None = None
    adapter: LoRAAdapter | None = None
    # wall-clock times (time.time_ns) of its life, for queue-time metrics and trace spans; 0 until it happens
    arrival_ns: int = field(default_factory=time.time_ns)
    queued_ns: int = 0  # when it joined the scheduler's queue (later than arrival while its grammar compiled)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    finished_ns: int = 0
    # prompt + output; the KV of the first num_computed_tokens of them is in the cache
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # chained hashes of every full block of token_ids, extended as tokens arrive
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # prompt tokens whose KV came from the prefix cache when first scheduled; -1 until then
    num_cached_tokens: int = -1
    # of those, how many came from each tier below the pool ("host", "disk", "peer": executor/kv/tiers/), loaded
    # into the pool before it started; the rest the pool held already
    cached_from: dict[str, int] = field(default_factory=dict)
    # the executor the gateway named as holding the prompt's first blocks (shared.protocol.KVPeer), for a pull
    kv_peer: object | None = None
    num_preemptions: int = 0
    # KV blocks it held x seconds (executor/kv/block_seconds.py): its tenant's bill for KV memory
    kv_block_seconds: float = 0.0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    # speculative decoding: proposals awaiting verification, never part of token_ids (so never hashed into the
    # prefix cache); draft_probs [len(spec_token_ids), V] is the distribution each was drawn from, None when
    # they were chosen deterministically (n-gram lookup, greedy draft), i.e. one-hot
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    # a draft model's KV is valid for this many leading tokens: it computes only when it proposes, catching up
    num_draft_computed: int = 0
    num_draft_tokens: int = 0  # proposals verified so far
    num_accepted_tokens: int = 0  # of which the target accepted
    # structured outputs (executor/structured/grammars.py): its grammar's matcher, None when unconstrained
    grammar: RequestGrammar | None = None
    # prompt logprobs (params.prompt_logprobs): the first num_scored_prompt_tokens prompt tokens have theirs (the
    # first token has none, so it counts from 1); they gather in prompt_logprobs until its first token goes out
    # with them, which sets it to None. A preemption keeps both, so no position is scored or sent twice.
    num_scored_prompt_tokens: int = 1
    prompt_logprobs: list[TokenLogprobs] | None = field(init=False)
    # parallel sampling (n > 1): the group's id (what the gateway knows it by) and this choice's index in it; the
    # choice-0 request carries the others in forks until its prompt is prefilled, then they fork from it. Only
    # choice 0 scores the prompt: the others start past it
    group_id: str = ""
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    # logit_bias and the penalties' inputs, built at its first sampled step and counted as tokens are appended
    # (executor/sampling/sampling_state.py); parallel sampling's choices share its prompt's part
    sampling_state: SamplingState | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        wants_prompt = self.params.prompt_logprobs is not None and self.index == 0
        self.prompt_logprobs = [] if wants_prompt else None
        self.sampling_state = self.sampling_state or SamplingState.of(self.params, self.prompt_token_ids)

    @property
    def cache_salt(self) -> str | bytes | None:
        """What its block hashes' chain starts from: its tenant's salt, and its adapter where it has one."""
        return adapter_salt(self.tenant.cache_salt, None if self.lora is None else self.lora.identity)

    @property
    def num_prompt_tokens_to_score(self) -> int:
        """Prompt tokens still without their logprob: 0 for requests that did not ask."""
        if self.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - self.num_scored_prompt_tokens)

    @property
    def group_size(self) -> int:
        """Sequences it will run as: itself and the choices still to fork from it."""
        return 1 + len(self.forks)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    def num_tokens_left(self, max_model_len: int) -> int:
        """How many more tokens it may still emit before max_tokens or max_model_len ends it."""
        return min(self.params.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    def set_spec_tokens(self, token_ids: list[int], probs: torch.Tensor | None = None) -> None:
        self.spec_token_ids = token_ids
        self.draft_probs = probs if token_ids else None

    def truncate_spec_tokens(self, n: int) -> None:
        """Keep only the first n proposals (what the step's budget or blocks allow)."""
        if n < len(self.spec_token_ids):
            self.spec_token_ids = self.spec_token_ids[:n]
            self.draft_probs = self.draft_probs[:n] if self.draft_probs is not None and n else None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        """An output token: the only way one is added, so the sampling state's counts follow every one."""
        self.token_ids.append(token_id)
        self.sampling_state.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """Token-level stop conditions; stop strings need text and live with the detokenizer."""
        params = self.params
        last = self.token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
