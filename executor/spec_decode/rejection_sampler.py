"""Verification of proposals against the target: greedy prefix matching, or rejection sampling that leaves the
output distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.sampling.sampler import (
    SamplingRow,
    TokenLogprobs,
    apply_penalties,
    draw,
    sampling_probs,
    token_logprobs,
    uniforms,
)


@dataclass(slots=True)
class Verified:
    token_ids: list[list[int]]  # per request: the accepted proposals, then one token of the target's own
    logprobs: list[list[TokenLogprobs | None]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """Accept proposal x with probability min(1, p(x) / q(x)); at the first rejection draw from the normalised
    max(0, p - q) and stop; if all k are accepted, draw a bonus token from the target's next distribution.

    target_probs holds k_i + 1 rows per request (its rows after one another); draft_probs[i] is [k_i, V], or
    None for proposals chosen deterministically, which count as q = one-hot.
    """
    device = target_probs.device
    counts = [len(d) for d in draft_token_ids]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count + 1)
    rows = torch.tensor([offsets[i] + j for i, c in enumerate(counts) for j in range(c)], dtype=torch.long)
    flat = [t for d in draft_token_ids for t in d]
    p_x = target_probs[rows.to(device), torch.tensor(flat, dtype=torch.long, device=device)]
    q_x = torch.ones_like(p_x)
    for i, probs in enumerate(draft_probs):
        if probs is not None and counts[i]:
            ids = torch.tensor(draft_token_ids[i], device=device)
            q_x[offsets[i] - i : offsets[i] - i + counts[i]] = probs.gather(1, ids[:, None]).squeeze(1)
    # u < p/q, written without the division: q can be 0 for a proposal its own draft could not have made
    accept = (torch.cat(uniforms(counts, generators, device)) * q_x < p_x).tolist()
    num_accepted, recovery = [], []
    start = 0
    for i, count in enumerate(counts):
        run = accept[start : start + count]
        start += count
        n = run.index(False) if False in run else count
        num_accepted.append(n)
        p = target_probs[offsets[i] + n]
        if n < count:
            q = draft_probs[i][n] if draft_probs[i] is not None else None
            residual = (p - q).clamp_min_(0) if q is not None else p.clone()
            if q is None:
                residual[draft_token_ids[i][n]] = 0
            total = residual.sum()
            # all-zero only if p <= q everywhere, i.e. p == q, where rejection cannot happen; rounding aside
            p = residual / total if total > 0 else p
        recovery.append(p)
    last = draw(torch.stack(recovery), generators).tolist()
    return [d[:n] + [t] for d, n, t in zip(draft_token_ids, num_accepted, last, strict=True)]


def _greedy_run(argmax: list[int], draft: list[int]) -> list[int]:
    """The longest prefix of draft that matches the target's argmax, then the target's next token."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return draft[:n] + [argmax[n]]


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
) -> Verified:
    """Tokens for each request from its k_i + 1 rows of target logits (k_i = len(draft_token_ids[i])).

    Row j of a request is the target's distribution after its output plus the first j proposals, so
    penalties see exactly the tokens they would have seen one step at a time.
    """
    positions = [
        SamplingRow(row.state, row.generator, draft[:j])
        for row, draft in zip(rows, draft_token_ids, strict=True)
        for j in range(len(draft) + 1)
    ]
    if logits.shape[0] != len(positions):
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(positions)} positions")
    penalised = apply_penalties(logits, positions)
    argmax = penalised.argmax(dim=-1).tolist()
    offsets = [0]
    for draft in draft_token_ids:
        offsets.append(offsets[-1] + len(draft) + 1)
    token_ids: list[list[int]] = [[] for _ in rows]
    random = []
    for i, row in enumerate(rows):
        if row.params.greedy:
            token_ids[i] = _greedy_run(argmax[offsets[i] : offsets[i + 1]], draft_token_ids[i])
        else:
            random.append(i)
    if random:
        index = torch.tensor(
            [r for i in random for r in range(offsets[i], offsets[i + 1])], device=logits.device
        )
        probs = sampling_probs(penalised[index], [positions[r].params for r in index.tolist()])
        sampled = rejection_sample(
            probs,
            [draft_token_ids[i] for i in random],
            [draft_probs[i] for i in random],
            [rows[i].generator for i in random],
        )
        for i, tokens in zip(random, sampled, strict=True):
            token_ids[i] = tokens
    emitted_rows = [offsets[i] + j for i, tokens in enumerate(token_ids) for j in range(len(tokens))]
    if any(row.params.logprobs is not None for row in rows):
        flat = torch.tensor([t for tokens in token_ids for t in tokens], device=logits.device)
        index = torch.tensor(emitted_rows, device=logits.device)
        flat_logprobs = token_logprobs(logits[index], flat, [positions[r] for r in emitted_rows])
    else:
        flat_logprobs = [None] * len(emitted_rows)
    logprobs, start = [], 0
    for tokens in token_ids:
        logprobs.append(flat_logprobs[start : start + len(tokens)])
        start += len(tokens)
    return Verified(token_ids, logprobs)
