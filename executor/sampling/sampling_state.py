"""A request's logit_bias and penalty inputs kept as tensors across steps, so that a step's sampling cost does not
grow with the size of its bias, its prompt or its output: rebuilt each step, a full-vocabulary logit_bias made
every other request in the batch 78x slower."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class PromptTerms:
    """What never changes in a request's sampling: its logit_bias as one dense [V] row, and which tokens its prompt
    holds (for repetition_penalty). Built at its first sampled step, on that step's device and at its logits'
    width, and shared by the choices of a parallel-sampling group."""

    params: SamplingParams
    prompt_token_ids: list[int]
    bias: torch.Tensor | None = None  # [V], the logits' dtype; None without logit_bias
    prompt_seen: torch.Tensor | None = None  # [V] bool; None without repetition_penalty
    built_for: tuple[int, torch.device, torch.dtype] | None = None

    def build(self, logits: torch.Tensor) -> PromptTerms:
        """Itself, built for logits' [S, V] shape, device and dtype the first time; later steps reuse it."""
        shape = (logits.shape[1], logits.device, logits.dtype)
        if self.built_for == shape:
            return self
        if self.built_for is not None:
            raise RuntimeError(f"sampling state built for {self.built_for}, now asked for {shape}")
        vocab_size, device, dtype = shape
        if self.params.logit_bias:
            tokens = torch.tensor(list(self.params.logit_bias), dtype=torch.long, device=device)
            values = torch.tensor(list(self.params.logit_bias.values()), dtype=dtype, device=device)
            # Dense, not sparse: adding a [V] row costs the same for one entry or the whole vocabulary, and
            # adding 0 leaves every other logit exactly as it was.
            self.bias = torch.zeros(vocab_size, dtype=dtype, device=device).index_put_((tokens,), values)
        if self.params.repetition_penalty != 1.0:
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.prompt_seen[torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)] = True
        self.built_for = shape
        return self


@dataclass(slots=True)
class SamplingState:
    """One choice's sampling state across steps: its request's PromptTerms, and how often each token occurs in
    its output so far (for the penalties), brought up to date once a step with the tokens appended since.

    Output tokens survive preemption by recompute, so the counts do too; speculative proposals are not output
    until accepted, so they are never appended here (verification counts them per row, see SamplingRow)."""

    prompt: PromptTerms
    output_counts: torch.Tensor | None = None  # [V] float32, built at the first step that needs it
    uncounted: list[int] = field(
        default_factory=list
    )  # appended since output_counts was last brought up to date

    @classmethod
    def of(cls, params: SamplingParams, prompt_token_ids: list[int]) -> SamplingState:
        """A request's own state, sharing no PromptTerms (parallel sampling's choices share theirs)."""
        return cls(PromptTerms(params, prompt_token_ids))

    @property
    def params(self) -> SamplingParams:
        return self.prompt.params

    @property
    def counts_output(self) -> bool:
        """Whether any penalty reads the output: without one, appending costs nothing."""
        params = self.params
        return params.repetition_penalty != 1.0 or bool(params.frequency_penalty or params.presence_penalty)

    def append(self, token_id: int) -> None:
        if self.counts_output:
            self.uncounted.append(token_id)

    def counts(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] occurrences of each token in the output so far, on logits' device and at their width."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(logits.shape[1], device=logits.device)
        elif (self.output_counts.shape[0], self.output_counts.device) != (logits.shape[1], logits.device):
            raise RuntimeError(
                f"output counts kept for {self.output_counts.shape[0]} tokens on "
                f"{self.output_counts.device}, now asked for {logits.shape[1]} on {logits.device}"
            )
        if self.uncounted:
            index = torch.tensor(self.uncounted, dtype=torch.long, device=logits.device)
            self.output_counts.index_add_(0, index, torch.ones(len(self.uncounted), device=logits.device))
            self.uncounted.clear()
        return self.output_counts
