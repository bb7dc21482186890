"""Turns one step's logits into tokens for the whole batch at once, with vLLM's sampling semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from executor.sampling.sampling_state import SamplingState
from kvkernels.sampling_ops import argmax_rows
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch and what the sampler needs to know about its request."""

    state: SamplingState  # its request's, kept across steps
    generator: torch.Generator | None  # set when params.seed is not None; advanced only by this row's draws
    # speculative decoding: the proposals this row's position comes after, which its penalties count as output
    # (they are not output until accepted)
    proposals: list[int] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.state.params


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # of the chosen token in the raw distribution, 1 = most likely
    top: list[tuple[int, float]]  # params.logprobs best (token id, logprob), best first


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits from its request's prebuilt [V] row; logits itself is left as
    it was."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return logits
    bias = torch.stack([rows[i].state.prompt.build(logits).bias for i in biased])
    if len(biased) == len(rows):
        return logits + bias
    return logits.index_add(0, torch.tensor(biased, device=logits.device), bias)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, then repetition (prompt + output), then frequency and presence (output only, as OpenAI
    defines them): the logits every sampling rule starts from. Only the rows with a penalty are computed."""
    logits = apply_logit_bias(logits, rows)
    penalised = [i for i, row in enumerate(rows) if row.state.counts_output]
    if not penalised:
        return logits
    if len(penalised) == len(rows):
        return _penalise(logits, rows)
    index = torch.tensor(penalised, device=logits.device)
    return logits.index_copy(0, index, _penalise(logits[index], [rows[i] for i in penalised]))


def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """apply_penalties for rows that each have at least one penalty."""
    device = logits.device
    output_counts = torch.stack([row.state.counts(logits) for row in rows])
    proposed = [(i, token) for i, row in enumerate(rows) for token in row.proposals]
    if proposed:
        rows_index, tokens = (torch.tensor(column, device=device) for column in zip(*proposed, strict=True))
        output_counts.index_put_(
            (rows_index, tokens), torch.ones(len(proposed), device=device), accumulate=True
        )
    params = [row.params for row in rows]
    repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeating:
        seen = output_counts > 0
        prompt_seen = torch.stack([rows[i].state.prompt.build(logits).prompt_seen for i in repeating])
        if len(repeating) == len(rows):
            seen |= prompt_seen
        else:  # the others' penalty is 1: what they count as seen changes nothing
            index = torch.tensor(repeating, device=device)
            seen[index] |= prompt_seen
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        # HF/vLLM: shrink positive logits and grow negative ones, so a seen token always loses.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        logits = logits - frequency * output_counts - presence * (output_counts > 0)
    return logits


# top-k / top-p rows look for their tokens among this many best first: a full sort of the vocabulary cost
# ~70 ms for 16 rows here, the top 1,024 a few ms. A row whose kept set may reach past them is sorted in full.
_CANDIDATES = 1024


def _filter_sorted(sorted_logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, lse: torch.Tensor | None):
    """Top-k then top-p over logits sorted best first: (filtered logits, mass before each position).

    lse, when given, is each row's logsumexp over the whole vocabulary after top-k, for candidate lists that
    hold only the head of the row."""
    # Threshold on the k-th value rather than on positions, so tied tokens stand or fall together.
    kth_value = sorted_logits.gather(1, (k.clamp(max=sorted_logits.shape[1]) - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1) if lse is None else (sorted_logits - lse).exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep the smallest prefix reaching top_p: drop a token once the ones before it already reach it
    # (never the first, as top_p > 0). Rows with top_p == 1 are exempt: rounding can push the sum to 1.
    drop = (mass_before >= p) & (p < 1)
    return sorted_logits.masked_fill(drop, float("-inf")), mass_before


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-p sees the distribution top-k left, as in vLLM; every row filters by one or both.

    The rows are looked at through their best _CANDIDATES tokens, which decide as a full sort would: a row's
    kept set ends inside that head when its top-k threshold lies above the head's last token (no ties run past
    it) or, without top-k, when the head already holds its top-p mass. Otherwise the rows are sorted in full."""
    vocab_size, device = logits.shape[1], logits.device
    k = torch.tensor([k if k > 0 else vocab_size for k in top_k], device=device).clamp_(max=vocab_size)
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    if max(_CANDIDATES, max(top_k)) < vocab_size:
        head, order = logits.topk(max(_CANDIDATES, max(top_k)), dim=-1)
        by_k = (k < vocab_size).unsqueeze(1)
        kth = head.gather(1, (k.clamp(max=head.shape[1]) - 1).unsqueeze(1))
        # the normaliser of what top-k leaves: the head's kept part, or (no top-k) the whole row
        lse = torch.where(
            by_k,
            head.masked_fill(head < kth, float("-inf")).logsumexp(-1, keepdim=True),
            logits.logsumexp(-1, keepdim=True),
        )
        filtered, mass_before = _filter_sorted(head, k, p, lse)
        inside = torch.where(by_k, head[:, -1:] < kth, mass_before[:, -1:] >= p)
        if bool(inside.all()):
            return torch.full_like(logits, float("-inf")).scatter_(1, order, filtered)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    filtered, _ = _filter_sorted(sorted_logits, k, p, None)
    return torch.empty_like(logits).scatter_(1, order, filtered)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The [S, V] distribution each row's token is drawn from; one-hot for greedy rows.

    Takes penalised logits; speculative decoding's rejection sampling needs exactly this distribution.
    """
    greedy = [p.greedy for p in params]
    # Greedy rows divide by 1 so their temperature of 0 never makes NaNs; they are replaced below.
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    scaled = logits / torch.tensor(temperature, device=logits.device).unsqueeze(1)
    filtering = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
    if len(filtering) == len(params):
        scaled = _apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
    elif filtering:
        index = torch.tensor(filtering, device=logits.device)
        kept = [params[i] for i in filtering]
        scaled[index] = _apply_top_k_top_p(scaled[index], [p.top_k for p in kept], [p.top_p for p in kept])
    probs = scaled.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)
        probs = torch.where(torch.tensor(greedy, device=logits.device).unsqueeze(1), one_hot, probs)
    return probs


def uniforms(counts: list[int], generators: list[torch.Generator | None], device) -> list[torch.Tensor]:
    """counts[i] draws from U[0, 1) for row i; a seeded row's come from its own generator only."""
    shared = torch.rand(sum(c for c, g in zip(counts, generators, strict=True) if g is None), device=device)
    out, used = [], 0
    for count, generator in zip(counts, generators, strict=True):
        if generator is None:
            out.append(shared[used : used + count])
            used += count
        else:
            out.append(torch.rand(count, generator=generator, device=device))
    return out


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (non-negative, any total) by inverse transform sampling, one random number a
    row (drawing noise for every vocabulary entry cost a fifth of a decode step); a seeded row's u comes from
    its own generator."""
    u = torch.cat(uniforms([1] * len(generators), generators, probs.device)).unsqueeze(1)
    return invert(probs, probs.cumsum(dim=-1), u)


def invert(probs: torch.Tensor, running: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token with mass whose running total passes u x the row's total.

    running is probs' running total as the device summed it. On the CPU each entry is its prefix sum rounded
    once, so a token without mass never has a total above the one before it and is never chosen. A GPU's
    float32 scan rounds its partial sums in another order: across a token without mass the total may rise (and
    elsewhere fall), and the search may land on it. Rows where it did are searched again over totals in which
    such a token takes the total of the last token with mass before it, made non-decreasing: the first entry
    past the target then always has mass. Only those rows pay for it (cummax costs four times the search)."""
    chosen = _search(running, u)
    missed = (probs.gather(1, chosen) == 0).squeeze(1)
    if missed.any():  # one sync, where the tokens are about to go to the host anyway
        rows = missed.nonzero().squeeze(1)
        repaired = torch.where(probs[rows] > 0, running[rows], 0.0).cummax(dim=-1).values
        chosen[rows] = _search(repaired, u[rows])
    return chosen.squeeze(1)


def _search(running: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[S, 1]: the first entry whose running total passes u x the last, a target strictly below that total
    (so the entry exists)."""
    total = running[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(running, target, right=True).clamp_(max=running.shape[1] - 1)


def token_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model distribution (before penalties and temperature), vLLM's default."""
    result: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = torch.tensor(wanted, device=raw_logits.device)
    found = logprobs_of(raw_logits[index], token_ids[index], [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, found, strict=True):
        result[i] = entry
    return result


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Row i's log-softmax (in float32) at token_ids[i], its rank, and the row's best num_top[i] entries."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    chosen_ids = token_ids.unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_logprobs, top_ids = (t.tolist() for t in logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1))
    result = []
    chosen_rows = zip(chosen_ids.squeeze(1).tolist(), chosen.squeeze(1).tolist(), num_top, strict=True)
    for j, (token_id, logprob, n) in enumerate(chosen_rows):
        # a structured output's mask leaves some rows fewer than n possible tokens: the impossible are not listed
        top = [(t, lp) for t, lp in zip(top_ids[j][:n], top_logprobs[j][:n], strict=True) if lp != -math.inf]
        result.append(TokenLogprobs(token_id, logprob, ranks[j], top))
    return result


class Sampler:
    """Penalties, then greedy argmax or a filtered random draw per row, all in batched tensor ops."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {list(logits.shape)}")
        penalised = apply_penalties(logits, rows)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(random) < len(rows):  # argmax over the vocabulary costs as much as drawing: only where needed
            token_ids = argmax_rows(penalised)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if random:
            generators = [rows[i].generator for i in random]
            for i, generator in zip(random, generators, strict=True):
                if rows[i].params.seed is not None and generator is None:
                    raise ValueError(f"row {i} has seed {rows[i].params.seed} but no generator")
            # Gather only when the batch is mixed: copying [S, V] logits for nothing costs real time.
            index = torch.tensor(random, device=logits.device) if len(random) < len(rows) else slice(None)
            probs = sampling_probs(penalised[index], [rows[i].params for i in random])
            token_ids[index] = draw(probs, generators)
        return SampleResult(token_ids.tolist(), token_logprobs(logits, token_ids, rows))
