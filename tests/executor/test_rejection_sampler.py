"""The rejection sampler's output follows the target distribution p whatever the proposal distribution q."""

from __future__ import annotations

import pytest
import torch

from executor.sampling.sampler import SamplingRow, sampling_probs
from executor.sampling.sampling_state import SamplingState
from executor.spec_decode import rejection_sample, verify
from shared.sampling_params import SamplingParams

NUM_SAMPLES = 20_000
SIGNIFICANCE = 1e-3  # a correct sampler fails one run in a thousand


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test that counts were drawn from probs (cells with p = 0 must stay empty)."""
    assert counts[probs == 0].sum() == 0, "a token the target gives no probability was emitted"
    expected = probs[probs > 0] * counts.sum()
    observed = counts[probs > 0].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = (probs > 0).sum() - 1
    return torch.special.gammaincc(df.double() / 2, statistic / 2).item()


def first_tokens(
    p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, bonus: torch.Tensor
) -> torch.Tensor:
    """Emitted first tokens of NUM_SAMPLES requests proposing one token each from q (or always `draft`)."""
    torch.manual_seed(0)
    if q is not None:
        drafts = torch.multinomial(q, NUM_SAMPLES, replacement=True).tolist()
    else:
        drafts = [int(draft)] * NUM_SAMPLES
    target = torch.stack([p, bonus]).repeat(NUM_SAMPLES, 1)
    out = rejection_sample(
        target,
        [[d] for d in drafts],
        [q[None] if q is not None else None] * NUM_SAMPLES,
        [None] * NUM_SAMPLES,
    )
    return torch.bincount(torch.tensor([o[0] for o in out]), minlength=p.numel())


P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1, 0.0])
CASES = {
    "q-near-p": torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05]),
    "q-far-from-p": torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]),
    "q-misses-tokens": torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
    "q-equals-p": P.clone(),
}


@pytest.mark.parametrize("q", CASES.values(), ids=CASES.keys())
def test_emitted_tokens_follow_p_for_a_sampled_draft(q):
    counts = first_tokens(P, q, None, torch.full((6,), 1 / 6))
    assert chi_square_p_value(counts, P) > SIGNIFICANCE


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_emitted_tokens_follow_p_for_a_deterministic_proposal(draft):
    """n-gram proposals count as q = one-hot, including a token p rules out."""
    counts = first_tokens(P, None, torch.tensor(draft), torch.full((6,), 1 / 6))
    assert chi_square_p_value(counts, P) > SIGNIFICANCE


def test_the_test_catches_a_wrong_sampler():
    """Taking every proposal as it comes (no rejection) leaves q's distribution, which the test must reject."""
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1, 0.0])  # close to P: off by 0.05 in two cells
    torch.manual_seed(0)
    counts = torch.bincount(torch.multinomial(q, NUM_SAMPLES, replacement=True), minlength=6)
    assert chi_square_p_value(counts, P) < SIGNIFICANCE
    # the likeliest bug: on rejection, drawing from p instead of the residual max(0, p - q)
    q = CASES["q-far-from-p"]
    drafts = torch.multinomial(q, NUM_SAMPLES, replacement=True)
    accepted = torch.rand(NUM_SAMPLES) * q[drafts] < P[drafts]
    resampled = torch.multinomial(P, NUM_SAMPLES, replacement=True)
    wrong = torch.bincount(torch.where(accepted, drafts, resampled), minlength=6)
    assert chi_square_p_value(wrong, P) < SIGNIFICANCE
    always_bonus = torch.bincount(torch.multinomial(P, NUM_SAMPLES, replacement=True), minlength=6)
    assert chi_square_p_value(always_bonus, P) > SIGNIFICANCE


def test_the_bonus_token_follows_the_next_distribution_when_all_are_accepted():
    bonus = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])
    p = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # the proposal 1 is always accepted
    torch.manual_seed(1)
    out = rejection_sample(
        torch.stack([p, bonus]).repeat(NUM_SAMPLES, 1),
        [[1]] * NUM_SAMPLES,
        [None] * NUM_SAMPLES,
        [None] * NUM_SAMPLES,
    )
    assert all(o[0] == 1 and len(o) == 2 for o in out)
    counts = torch.bincount(torch.tensor([o[1] for o in out]), minlength=6)
    assert chi_square_p_value(counts, bonus) > SIGNIFICANCE


def test_verify_follows_temperature_top_k_top_p_and_keeps_seeds():
    """verify() draws from the request's filtered target distribution, and a seed fixes its draws."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2])
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    p = sampling_probs(logits[None], [params])[0]
    assert (p == 0).sum() >= 3  # the filters took something out
    n = 20_000
    rows = [SamplingRow(SamplingState.of(params, [1]), None)] * n
    torch.manual_seed(2)
    drafts = [[int(t)] for t in torch.randint(0, 8, (n,))]  # deterministic proposals (q one-hot), any token
    out = verify(logits.repeat(2 * n, 1), rows, drafts, [None] * n)
    counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=8)
    assert chi_square_p_value(counts, p) > SIGNIFICANCE

    def seeded(seed):
        generator = torch.Generator().manual_seed(seed)
        row = SamplingRow(SamplingState.of(params, [1]), generator)
        return [verify(logits.repeat(3, 1), [row], [[4, 0]], [None]).token_ids[0] for _ in range(20)]

    assert seeded(7) == seeded(7) and seeded(7) != seeded(8)


def test_greedy_verification_keeps_the_matching_prefix_and_the_target_token():
    params = SamplingParams(temperature=0)
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 5.0
    row = SamplingRow(SamplingState.of(params, [1]), None)
    assert verify(logits, [row], [[2, 3, 0]], [None]).token_ids == [[2, 3, 1]]
    assert verify(logits, [row], [[2, 3, 1]], [None]).token_ids == [[2, 3, 1, 4]]
    assert verify(logits, [row], [[5, 3, 1]], [None]).token_ids == [[2]]
