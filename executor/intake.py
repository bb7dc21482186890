"""Request intake: a request checked against what this engine can run, built as its n choices, and kept in the
engine's one map of unfinished requests until its last choice ends.

A bad request raises ValueError naming the field and touches nothing. Parallel sampling (n > 1): choice 0 keeps the
request's id and carries the others in its forks until its prompt is prefilled (executor/scheduling/scheduler.py's
fork).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from executor.engine_config import EngineConfig
from executor.engine_setup import Models
from executor.lora.adapters import Adapters, KnownAdapter
from executor.request import Request
from executor.sampling.sampling_state import PromptTerms, SamplingState
from executor.structured.grammar_masks import RequestGrammar
from executor.structured.grammar_queue import GrammarQueue
from shared.block_hash import hash_blocks
from shared.sampling_params import SamplingParams
from shared.tenant import MAX_TENANT_WEIGHT, Tenant

log = logging.getLogger("kvserve.engine")

HASHES_CHECKED = 4  # leading blocks of a prompt whose gateway hashes are compared with the engine's


def choice_request_id(group_id: str, index: int) -> str:
    """The engine's own id for choice index > 0 of a request with n > 1 (choice 0 keeps the request's id)."""
    return f"{group_id}/{index}"


class Intake:
    def __init__(
        self,
        models: Models,
        config: EngineConfig,
        num_blocks: int,
        device: torch.device,
        grammars: GrammarQueue,
        adapters: Adapters | None = None,
    ) -> None:
        self.adapters = adapters  # the LoRA adapters it serves (--enable-lora), None: the base model alone
        self.tokenizer, self.vocab_size, self.eos_token_ids = (
            models.tokenizer,
            models.vocab_size,
            models.eos_token_ids,
        )
        self.max_model_len, self.block_size, self.num_blocks = (
            models.max_model_len,
            config.block_size,
            num_blocks,
        )
        self.max_num_seqs, self.device = config.max_num_seqs, device
        self.grammar_queue = grammars
        self.requests: dict[str, Request] = {}  # unfinished, by their own id (a choice's, for n > 1)
        self.groups: dict[str, list[Request]] = {}  # by the id they were added under: every choice
        self.block_hash_mismatches = 0  # requests whose gateway hashed their prompt otherwise

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        tenant: Tenant,
        block_hashes: Sequence[bytes],
        priority: int,
        lora: str | None = None,
    ) -> list[Request]:
        """Check and build a request's choices, the first carrying the others in its forks; it raises EngineBusy
        for one that must wait for a compile while too many do (GrammarQueue.compiled)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if not 0 < tenant.weight <= MAX_TENANT_WEIGHT:  # the fair share divides service by it
            raise ValueError(
                f"weight: a tenant's weight must be in (0, {MAX_TENANT_WEIGHT:g}], got {tenant.weight}"
            )
        token_ids = self._prompt_token_ids(prompt)
        self._check_fits(len(token_ids), params)
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        ids = [request_id] + [choice_request_id(request_id, i) for i in range(1, params.n)]
        taken = next((i for i in ids if i in self.requests or i in self.groups), None)
        if taken is not None:
            raise ValueError(f"request_id: {taken!r} is already in use")
        known = None if lora is None else self.known_adapter(lora)
        spec = params.structured_outputs
        compiled = None if spec is None else self.grammar_queue.compiled(spec, tenant)
        prompt_terms = PromptTerms(params, token_ids)  # built once, at the first step, for every choice
        choices = [
            Request(
                choice_id,
                token_ids,
                params,
                self.eos_token_ids,
                tenant=tenant,
                priority=priority,
                lora=known,
                generator=self._generator(params.choice_seed(index)),
                grammar=None if compiled is None else RequestGrammar(compiled),  # a matcher each
                group_id=request_id,
                index=index,
                sampling_state=SamplingState(prompt_terms),
            )
            for index, choice_id in enumerate(ids)
        ]
        request, request.forks = choices[0], choices[1:]
        if block_hashes:
            self._check_block_hashes(request, block_hashes)
        for choice in choices:
            self.requests[choice.request_id] = choice
        self.groups[request_id] = choices
        return choices

    def adapters_in_use(self) -> set[str]:
        """The adapters whose weights unfinished requests hold: host memory keeps them past --max-cpu-loras."""
        return {r.lora.name for r in self.requests.values() if r.adapter is not None}

    def known_adapter(self, name: str) -> KnownAdapter:
        if self.adapters is None:
            raise ValueError(
                f"lora: this executor serves no adapters (start it with --enable-lora), asked for {name!r}"
            )
        return self.adapters.resolve(name)

    def stopping(self, request_id: str, index: int | None) -> list[Request]:
        """The unfinished choices an abort of request_id (every choice, or only choice index) stops. A choice still
        to fork from the first one ends with it, since the prompt it waits for is the first one's."""
        group = self.groups.get(request_id, [])
        stopped = [c for c in group if c.request_id in self.requests and index in (None, c.index)]
        if any(c.forks for c in stopped):
            stopped = [c for c in group if c.request_id in self.requests]
        return stopped

    def forget(self, request: Request) -> bool:
        """Drop a finishing choice; whether it was its group's last."""
        self.requests.pop(request.request_id, None)
        group = self.groups.get(request.group_id, [])
        if any(c.request_id in self.requests for c in group):
            return False
        self.groups.pop(request.group_id, None)
        return True

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: expected a string or a list of token ids")
        if not prompt:
            raise ValueError("prompt_token_ids: must not be empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(prompt)

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse what could never run: past max_model_len, or more blocks than the pool holds for the whole
        group (the prompt's full blocks once, then each choice's own), or more choices than --max-num-seqs."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(f"n: {params.n} choices exceed this executor's max_num_seqs {self.max_num_seqs}")
        shared = num_prompt_tokens // self.block_size
        needed = shared + params.n * (-(-total // self.block_size) - shared)
        if needed > self.num_blocks:
            what = f"n {params.n} x " if params.n > 1 else ""
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + {what}max_tokens {params.max_tokens} need more "
                f"KV blocks than the whole pool holds ({self.num_blocks} x {self.block_size} tokens)"
            )

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(self.device).manual_seed(seed)

    def _check_block_hashes(self, request: Request, sent: Sequence[bytes]) -> None:
        """Compare the gateway's first block hashes with this engine's chain: where they disagree, routing by
        cached prefix finds nothing here, and the hit rate drops to 0 without a word otherwise."""
        n = min(len(sent), HASHES_CHECKED)
        request.block_hashes = hash_blocks(
            request.token_ids[: n * self.block_size], self.block_size, request.cache_salt
        )
        if list(sent[:n]) == request.block_hashes:
            return
        self.block_hash_mismatches += 1
        if self.block_hash_mismatches == 1:
            log.warning(
                "request %s: the gateway's block hashes differ from this executor's (block size %d): likely a "
                "gateway and executor that disagree on block size, cache salt or hash function; prefix-cache "
                "routing to this executor will miss (counted in kvserve_block_hash_mismatches_total, this "
                "warning once)",
                request.request_id,
                self.block_size,
            )
