"""What the LoRA benchmark sends: arms spread evenly over their adapters, prompts no two requests share, and the
load probe's arithmetic."""

from collections import Counter

from bench.lora.workload import PROBE_STREAM, Shape, arm_models, arm_name, load_summary, prompts


def test_each_round_spreads_its_requests_evenly_over_the_arms_adapters():
    shape = Shape(streams=16, rounds=3)
    names = [f"a{i}" for i in range(8)]
    for count in (1, 4, 8):
        models = arm_models("base", names[:count], shape.requests)
        for r in range(shape.rounds):
            round_models = Counter(models[r * shape.streams : (r + 1) * shape.streams])
            assert set(round_models) == set(names[:count])
            assert set(round_models.values()) == {shape.streams // count}
    assert arm_models("base", [], 5) == ["base"] * 5
    assert [arm_name(n) for n in (0, 1, 4)] == ["base only", "1 adapter", "4 adapters"]


def test_no_two_requests_share_a_prompt_within_or_across_arms_and_runs_repeat():
    texts = [t for stream in (0, 1, 4, 8, PROBE_STREAM) for t in prompts(48, 128, 0, stream)]
    assert len({t[:60] for t in texts}) == len(texts)
    assert all(100 <= len(t.split()) <= 128 for t in texts)  # about one token a word
    assert prompts(3, 32, 0, 4) == prompts(3, 32, 0, 4)
    assert prompts(3, 32, 1, 4) != prompts(3, 32, 0, 4)


def test_load_time_is_the_first_use_less_the_loaded_ttft_per_adapter():
    load = load_summary(
        [0.20, 0.30, 0.25],
        {"a0": 1.0, "a1": 0.9, "a2": None},
        {"a0": 0.3, "a1": 0.3, "a2": 0.3},
        ["a2: HTTP 400: bad adapter"],
    )
    assert load["base_ttft_s"] == 0.25 and load["loaded_ttft_s"] == 0.3
    assert abs(load["load_s"] - 0.65) < 1e-9  # median of 0.7 and 0.6; a2 failed and counts for nothing
    assert abs(load["first_use_ttft_s"] - 0.95) < 1e-9 and abs(load["first_use_minus_base_s"] - 0.70) < 1e-9
    empty = load_summary([None], {"a0": None}, {"a0": None}, [])
    assert empty["load_s"] is None and empty["first_use_minus_base_s"] is None
