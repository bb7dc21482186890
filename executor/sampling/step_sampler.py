"""A step's logits into tokens, beside the model runner: the prompt rows scored (prompt logprobs), each n > 1 group
whose prompt the step finished forked into its choices, grammar masks applied, then one token sampled per
request, or its proposals verified and one more drawn."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.model_runner import PROMPT_LOGITS_ROWS, ModelRunner, StepLogits
from executor.request import Request
from executor.sampling.sampler import Sampler, SamplingRow, TokenLogprobs, logprobs_of
from executor.spec_decode import verify
from executor.structured.grammar_masks import step_bitmask


@dataclass(slots=True)
class SampledTokens:
    """Each request's new tokens (one sampled, or its accepted proposals and one more), aligned with requests."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


class StepSampler:
    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner  # its lm head scores the prompt rows
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        # spent building and applying token masks, for bench/offline/structured_outputs.py
        self.mask_seconds = 0.0

    def __call__(self, step: StepLogits, fork: Callable[[Request], list[Request]]) -> SampledTokens:
        """fork(request): the choices a group's first choice forks into now its prompt is prefilled."""
        if step.prompt_rows:
            self._score_prompts(step)
        step = self._fork(step, fork)  # after scoring: forks start past the prompt and score none of it
        token_ids, logprobs = self._sample(step)
        return SampledTokens(step.requests, token_ids, logprobs)

    def _score_prompts(self, step: StepLogits) -> None:
        """Prompt logprobs from the rows of this step's forward pass: raw distribution, log-softmax in float32,
        PROMPT_LOGITS_ROWS rows of logits at a time."""
        targets, num_top = [], []
        for request, first, count in step.prompt_rows:
            targets += request.prompt_token_ids[first : first + count]
            num_top += [request.params.prompt_logprobs] * count
        index = torch.tensor(targets, device=step.prompt_hidden.device)
        scored: list[TokenLogprobs] = []
        for start in range(0, len(targets), PROMPT_LOGITS_ROWS):
            end = start + PROMPT_LOGITS_ROWS
            logits = self.runner.logits(step.prompt_hidden[start:end])
            scored += logprobs_of(logits, index[start:end], num_top[start:end])
        done = 0
        for request, first, count in step.prompt_rows:
            request.prompt_logprobs += scored[done : done + count]
            request.num_scored_prompt_tokens = first + count
            done += count

    def _fork(self, step: StepLogits, fork: Callable[[Request], list[Request]]) -> StepLogits:
        """Parallel sampling: a group whose prompt this step finished becomes its n choices, each sampling its
        first token from the prompt's one row of logits (a copy each, as masks and penalties work in place)."""
        if not any(r.forks for r in step.requests):
            return step
        requests, num_rows, rows, offset = [], [], [], 0
        for request, n in zip(step.requests, step.num_rows, strict=True):
            group = [request, *fork(request)] if request.forks else [request]
            for choice in group:
                requests.append(choice)
                num_rows.append(n)
                rows.extend(range(offset, offset + n))
            offset += n
        index = torch.tensor(rows, device=step.logits.device)
        return StepLogits(
            requests, step.logits.index_select(0, index), num_rows, step.prompt_rows, step.prompt_hidden
        )

    def _sample(self, step: StepLogits) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        rows = [SamplingRow(r.sampling_state, r.generator) for r in step.requests]
        if not rows:
            return [], []
        drafts = [r.spec_token_ids for r in step.requests]
        # structured outputs: constrained rows' disallowed tokens to -inf, before sampling and logprobs
        started = time.perf_counter()
        mask = step_bitmask([r.grammar for r in step.requests], drafts, self.vocab_size)
        if mask is not None:
            mask.apply(step.logits)
            self.mask_seconds += time.perf_counter() - started
        if all(n == 1 for n in step.num_rows):
            result = self.sampler(step.logits, rows)
            return [[t] for t in result.token_ids], [[lp] for lp in result.logprobs]
        verified = verify(step.logits, rows, drafts, [r.draft_probs for r in step.requests])
        return verified.token_ids, verified.logprobs
