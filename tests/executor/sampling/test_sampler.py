import math

import pytest
import torch

from executor.sampling import sampler as sampler_module
from executor.sampling.sampler import Sampler, SamplingRow, apply_penalties, draw, sampling_probs
from executor.sampling.sampling_state import SamplingState
from shared.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Probabilities 0.5, 0.3, 0.15, 0.05: every filter case below has a clear margin to its threshold.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def make_row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    device: str = "cpu",
) -> SamplingRow:
    generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
    state = SamplingState.of(params, prompt or [])
    for token_id in output or []:
        state.append(token_id)
    return SamplingRow(state, generator)


FILTER_CASES = [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_k=10), {0, 1, 2, 3}),
    (SamplingParams(top_p=0.4), {0}),
    (SamplingParams(top_p=0.75), {0, 1}),
    (SamplingParams(top_p=0.85), {0, 1, 2}),
    (SamplingParams(top_p=1.0), {0, 1, 2, 3}),
    (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.1
    (SamplingParams(min_p=0.5), {0, 1}),  # threshold 0.25
    # top-p sees the renormalised top-2 (0.625, 0.375), so 0.6 keeps one token; on raw probs it would keep two.
    (SamplingParams(top_k=2, top_p=0.6), {0}),
    # temperature 2 flattens to (0.38, 0.29, 0.21, 0.12) before top-p, so 0.75 keeps three.
    (SamplingParams(temperature=2.0, top_p=0.75), {0, 1, 2}),
    (SamplingParams(temperature=0.0), {0}),
]


@pytest.mark.parametrize("device", DEVICES)
def test_filters_leave_exactly_the_expected_tokens_renormalised(device: str) -> None:
    params = [p for p, _ in FILTER_CASES]
    probs = sampling_probs(LOGITS.to(device).expand(len(params), -1), params).cpu()
    for row, (p, allowed) in zip(probs, FILTER_CASES, strict=True):
        assert set(row.nonzero().flatten().tolist()) == allowed, p
        kept = torch.tensor(sorted(allowed))
        flat = (LOGITS / (p.temperature or 1.0)).softmax(-1)
        expected = flat[kept] / flat[kept].sum() if not p.greedy else torch.ones(1)
        torch.testing.assert_close(row[kept], expected)


def test_top_p_of_one_keeps_every_token_of_a_large_vocabulary() -> None:
    """Float32 cumulative sums over a big vocabulary reach 1.0 early; top_p=1 must still mean off."""
    torch.manual_seed(0)
    logits = torch.randn(8, 32_000) * 2
    params = [SamplingParams(top_p=1.0)] * 7 + [SamplingParams(top_k=5)]  # the top-k row forces the sort path
    probs = sampling_probs(logits, params)
    assert bool((probs[:7] > 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_draws_only_allowed_tokens_per_row(device: str) -> None:
    copies = 400  # the rarest allowed token (0.05) is missed by all copies with probability 1e-9
    cases = FILTER_CASES * copies
    torch.manual_seed(0)
    result = Sampler()(LOGITS.to(device).expand(len(cases), -1).clone(), [make_row(p) for p, _ in cases])
    for i, (_, allowed) in enumerate(FILTER_CASES):
        assert set(result.token_ids[i :: len(FILTER_CASES)]) == allowed


def test_greedy_takes_argmax_and_lowest_id_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0]])
    rows = [make_row(SamplingParams(temperature=0.0)), make_row(SamplingParams(temperature=0.0))]
    rows.append(make_row(SamplingParams(temperature=1.5, top_k=1)))
    assert Sampler()(logits, rows).token_ids == [1, 0, 1]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        (
            SamplingParams(temperature=0.5, top_k=3),
            (LOGITS / 0.5).softmax(-1)[:3] / (LOGITS / 0.5).softmax(-1)[:3].sum(),
        ),
    ],
)
def test_sample_frequencies_follow_the_distribution(
    params: SamplingParams, expected: torch.Tensor, seeded: bool
) -> None:
    n = 20_000
    torch.manual_seed(1)
    # Seeded: every row shares one generator, so the per-row seeded draws are what is being measured.
    generator = torch.Generator().manual_seed(7) if seeded else None
    rows = [SamplingRow(SamplingState.of(params, []), generator) for _ in range(n)]
    tokens = torch.tensor(Sampler()(LOGITS.expand(n, -1).clone(), rows).token_ids)
    counts = torch.bincount(tokens, minlength=len(PROBS)).float()
    assert counts[len(expected) :].sum() == 0
    # 16.27 is the 0.999 quantile of chi-square with 3 degrees of freedom; the seeds are fixed, so no flakes.
    assert _chi_square(counts[: len(expected)], expected) < 16.27


def _draw_steps(
    device: str, num_neighbours: int, position: int, other_seed: int, steps: int = 8
) -> list[int]:
    """Generates with a seed-42 row among neighbours; returns the seeded row's tokens."""
    vocab = 64
    torch.manual_seed(1234)
    logits = torch.randn(steps, vocab, device=device) * 2
    target = make_row(SamplingParams(seed=42, top_p=0.9), device=device)
    neighbours = [
        make_row(SamplingParams(), device=device),
        make_row(SamplingParams(seed=other_seed, top_k=5), device=device),
        make_row(SamplingParams(temperature=0.0), device=device),
        make_row(SamplingParams(temperature=0.7, min_p=0.1, frequency_penalty=1.0), device=device),
    ][:num_neighbours]
    rows = neighbours[:position] + [target] + neighbours[position:]
    torch.manual_seed(other_seed)  # the default generator's state must not matter either
    tokens = []
    for step in range(steps):
        batch = torch.randn(len(rows), vocab, device=device) * 3
        batch[position] = logits[step]
        token_ids = Sampler()(batch, rows).token_ids
        for row, token_id in zip(rows, token_ids, strict=True):
            row.state.append(token_id)
        tokens.append(token_ids[position])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_reproducible_wherever_it_sits(device: str) -> None:
    alone = _draw_steps(device, num_neighbours=0, position=0, other_seed=0)
    assert _draw_steps(device, num_neighbours=4, position=2, other_seed=1) == alone
    assert _draw_steps(device, num_neighbours=4, position=4, other_seed=2) == alone
    assert _draw_steps(device, num_neighbours=2, position=0, other_seed=3) == alone


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_give_different_tokens(device: str) -> None:
    logits = torch.zeros(
        1, 1000, device=device
    )  # uniform: 20 equal draws by chance is impossible in practice
    sequences = []
    for seed in (1, 2):
        row = make_row(SamplingParams(seed=seed), device=device)
        sequences.append([Sampler()(logits, [row]).token_ids[0] for _ in range(20)])
    assert sequences[0] != sequences[1]


def test_seeded_row_without_generator_is_refused() -> None:
    row = make_row(SamplingParams(seed=3))
    row.generator = None
    with pytest.raises(ValueError, match="seed"):
        Sampler()(torch.zeros(1, 4), [row])


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_follow_openai_and_vllm_definitions(device: str) -> None:
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5, 1.0], device=device).expand(4, -1).clone()
    prompt, output = [0, 1], [2, 2, 3]
    rows = [
        make_row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt,
            output,
        ),
        make_row(SamplingParams(), prompt, output),
        # presence and frequency count generated tokens only: tokens 0 and 1 are only in the prompt.
        make_row(SamplingParams(presence_penalty=1.0), prompt, output),
        make_row(SamplingParams(frequency_penalty=-1.0), prompt, output),
    ]
    before = logits.clone()
    penalised = apply_penalties(logits, rows).cpu()
    expected = torch.tensor(
        [
            # prompt-only: 2/2, -1*2; output: 3/2 - 0.5*2 - 0.25, 0.5/2 - 0.5 - 0.25; unseen: unchanged
            [1.0, -2.0, 0.25, -0.5, 1.0],
            [2.0, -1.0, 3.0, 0.5, 1.0],
            [2.0, -1.0, 2.0, -0.5, 1.0],
            [2.0, -1.0, 5.0, 1.5, 1.0],
        ]
    )
    torch.testing.assert_close(penalised, expected)
    assert torch.equal(logits, before)


def test_penalties_steer_greedy_while_logprobs_stay_raw() -> None:
    logits = torch.tensor([[1.0, 0.9, -2.0]])
    row = make_row(SamplingParams(temperature=0.0, frequency_penalty=0.1, logprobs=2), output=[0, 0])
    result = Sampler()(logits, [row])
    assert result.token_ids == [1]  # 1.0 - 0.1 * 2 = 0.8 < 0.9
    raw = logits.log_softmax(-1)[0]
    lp = result.logprobs[0]
    assert (lp.token_id, lp.rank) == (1, 2)
    assert lp.logprob == pytest.approx(float(raw[1]))
    assert [t for t, _ in lp.top] == [0, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_forces_and_bans_tokens_while_logprobs_stay_raw(device: str) -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 3, device=device)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(temperature=0.0, logit_bias={"3": 100}, logprobs=0)),
        make_row(SamplingParams(temperature=0.0, logit_bias={0: -100})),  # the argmax banned: next best
        make_row(
            SamplingParams(temperature=1.0, seed=3, logit_bias={0: -100, 1: -100, 3: -100}), device=device
        ),
    ]
    result = Sampler()(logits, rows)
    assert result.token_ids == [3, 1, 2]
    assert result.logprobs[0].rank == 4  # the raw distribution's worst token
    assert torch.equal(logits, before)
    bias_then_penalty = apply_penalties(
        logits[:1], [make_row(SamplingParams(logit_bias={1: 2}, repetition_penalty=2), output=[1])]
    )
    assert bias_then_penalty[0, 1].item() == pytest.approx((1.0 + 2) / 2)


@pytest.mark.parametrize("device", DEVICES)
def test_state_kept_across_steps_penalises_as_one_built_from_the_whole_history(device: str) -> None:
    """The bias and the prompt's tokens are built at the first step and kept; output counts grow with each
    appended token; a row's proposals count as its output for that row only. Each step must penalise exactly
    as state built afresh from the prompt and the whole output would."""
    torch.manual_seed(4)
    vocab = 300
    prompt = torch.randint(0, vocab, (500,)).tolist()
    params = [
        SamplingParams(repetition_penalty=1.4, logit_bias={t: t / 100 - 1 for t in range(0, vocab, 3)}),
        SamplingParams(frequency_penalty=0.3, presence_penalty=-0.5),
        SamplingParams(),  # no penalty: left out of the penalised rows
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.2, logit_bias={5: 50}),
        SamplingParams(logit_bias={7: -3}),
    ]
    kept = [make_row(p, prompt, device=device) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(6):
        logits = torch.randn(len(params), vocab, device=device) * 3
        proposals = [torch.randint(0, vocab, (step % 3,)).tolist() for _ in params]
        for row, proposed in zip(kept, proposals, strict=True):
            row.proposals = proposed
        fresh = [
            make_row(p, prompt, out + proposed, device)
            for p, out, proposed in zip(params, outputs, proposals, strict=True)
        ]
        assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, fresh))
        if step == 0:
            first = [(r.state.prompt.bias, r.state.prompt.prompt_seen, r.state.output_counts) for r in kept]
        for row, output in zip(kept, outputs, strict=True):
            token_id = int(torch.randint(0, vocab, ()))
            row.state.append(token_id)
            output.append(token_id)
    # nothing was rebuilt: the same tensors, the counts grown in place by the tokens of each step
    for row, tensors in zip(kept, first, strict=True):
        now = (row.state.prompt.bias, row.state.prompt.prompt_seen, row.state.output_counts)
        assert all(a is b for a, b in zip(now, tensors, strict=True))
    assert [len(row.state.uncounted) for row in kept] == [1, 1, 0, 1, 0]  # the last step's, not yet counted


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_rank_and_top(device: str) -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 50, device=device) * 3
    rows = [
        make_row(SamplingParams(logprobs=None)),
        make_row(SamplingParams(logprobs=0, temperature=0.3, repetition_penalty=1.5), prompt=[1, 2, 3]),
        make_row(SamplingParams(logprobs=5, temperature=2.0, top_k=20)),
        make_row(SamplingParams(logprobs=20, temperature=0.0)),
    ]
    result = Sampler()(logits, rows)
    raw = logits.cpu().log_softmax(-1)
    assert result.logprobs[0] is None
    for i in range(1, 4):
        lp, token_id = result.logprobs[i], result.token_ids[i]
        assert lp.token_id == token_id
        assert lp.logprob == pytest.approx(float(raw[i, token_id]), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token_id]).sum())
        n = rows[i].params.logprobs
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == raw[i].topk(n).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(math.isclose(v, float(raw[i, t]), abs_tol=1e-5) for t, v in lp.top)
    assert result.logprobs[3].rank == 1  # greedy takes the best raw token when no penalty applies


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 4), [make_row(SamplingParams())])


def _kept_by_full_sort(logits: torch.Tensor, params: list[SamplingParams], monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(sampler_module, "_CANDIDATES", logits.shape[1])  # no head: every row sorted in full
        return sampling_probs(logits, params) > 0


@pytest.mark.parametrize("spread", [1.0, 3.0, 8.0])
def test_filters_over_the_head_keep_what_a_full_sort_keeps(spread: float, monkeypatch) -> None:
    """A realistic vocabulary: top-k and top-p decided among the best tokens must match the full sort, and
    where the head cannot hold a row's top-p mass (flat logits) the full sort serves."""
    torch.manual_seed(3)
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, temperature=0.7),
        SamplingParams(top_k=40),
        SamplingParams(top_k=2000),  # more than the head: the head grows to it
        SamplingParams(top_k=50, top_p=0.8),
        SamplingParams(top_p=0.95, min_p=0.01),
        SamplingParams(),  # not filtered, in a batch that is
    ]
    logits = torch.randn(len(params), 49_152) * spread
    logits[2, 100:140] = 20.0  # a run of ties at the top-k threshold, all inside the head
    probs = sampling_probs(logits, params)
    assert torch.equal(probs > 0, _kept_by_full_sort(logits, params, monkeypatch))
    assert bool((probs[-1] > 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(params)))


def test_top_k_ties_running_past_the_head_fall_back_to_the_sort(monkeypatch) -> None:
    logits = torch.zeros(2, 4096)
    logits[:, :10] = 5.0
    params = [SamplingParams(top_k=20), SamplingParams(top_p=0.2)]  # 4,086 tokens tie at the 20th value
    monkeypatch.setattr(sampler_module, "_CANDIDATES", 64)
    probs = sampling_probs(logits, params)
    assert int((probs[0] > 0).sum()) == 4096  # ties stand together, as the full sort decides
    assert torch.equal(probs > 0, _kept_by_full_sort(logits, params, monkeypatch))


def test_draw_never_takes_a_token_without_mass() -> None:
    torch.manual_seed(0)
    probs = torch.zeros(4, 49_152)
    probs[0, -1] = 1.0  # all mass on the last token
    probs[1, 0] = 1e-30  # a tiny mass at the front, none after it
    probs[2, ::2] = 1.0  # every other token
    probs[3, 7] = 0.25  # a total other than 1
    rows = torch.cat([probs] * 500)
    tokens = draw(rows, [None] * len(rows))
    assert set(tokens[0::4].tolist()) == {49_151}
    assert set(tokens[1::4].tolist()) == {0}
    assert all(t % 2 == 0 for t in tokens[2::4].tolist())
    assert set(tokens[3::4].tolist()) == {7}


def test_a_token_without_mass_is_never_drawn_from_running_totals_rounded_as_a_gpu_may() -> None:
    """A GPU's float32 scan rounds partial sums in its own order: its running total may rise across a token
    without mass, or fall. Forced here on the CPU in float32: totals nudged by an ulp either way, and u values
    aimed at every raised step; the plain search then lands on tokens without mass, invert never does."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.zeros(2, 4096)
    probs[:, ::3] = torch.rand(2, 1366, generator=generator)  # tokens 3k + 1 and 3k + 2 have none
    probs[1, -2:] = 0.0  # and a row whose last tokens have none
    running = probs.cumsum(dim=-1)
    inf = torch.tensor(float("inf"))
    nudged = torch.rand(running.shape, generator=generator) < 0.5
    running = torch.where(nudged & (probs == 0), running.nextafter(inf), running)  # rises across no mass
    running = torch.where(nudged & (probs > 0), running.nextafter(-inf), running)  # and falls
    total = running[:, -1:]
    # each step up at a token without mass, hit: u x total just at the total before it
    steps = (probs == 0) & nudged
    u = torch.cat([torch.where(steps, running.nextafter(-inf) / total, 0.0), torch.rand(2, 4096)], dim=1).T
    for row in range(2):
        rows = probs[row].expand(len(u), -1).contiguous()
        totals = running[row].expand(len(u), -1).contiguous()
        plain = sampler_module._search(totals, u[:, row : row + 1]).squeeze(1)
        assert (rows.gather(1, plain[:, None]) == 0).sum() > 100  # the case is forced
        chosen = sampler_module.invert(rows, totals, u[:, row : row + 1])
        assert bool((rows.gather(1, chosen[:, None]) > 0).all())


def test_draw_takes_one_number_from_a_seeded_rows_generator() -> None:
    """A seeded row's draw depends on its generator alone: one uniform each, so its stream stays aligned."""
    probs = torch.full((1, 1000), 1.0)
    generator = torch.Generator().manual_seed(11)
    first = [int(draw(probs, [generator])) for _ in range(5)]
    replay = torch.Generator().manual_seed(11)
    expected = [int(torch.rand(1, generator=replay) * 1000) for _ in range(5)]
    assert first == expected
