import pytest

from shared.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (
        16,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.seed, params.stop, params.stop_token_ids, params.ignore_eos, params.logprobs) == (
        None,
        [],
        [],
        False,
        None,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not params.greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": None}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": "42"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": "5"}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e30}, "repetition_penalty"),  # OpenAI-style bounds: [0, 2] as SGLang's
        ({"repetition_penalty": 2.01}, "repetition_penalty"),
        ({"temperature": 1e30}, "temperature"),  # OpenAI's range is [0, 2]
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # an int too large for a float is not an OverflowError
        ({"top_p": -(10**400)}, "top_p"),
        ({"seed": 2**63}, "seed"),  # past 64 bits: msgpack and torch's generators refuse it
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"logit_bias": {"1" * 30: 1}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {True: 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: "high"}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ],
)
def test_invalid_value_is_refused_naming_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_logit_bias_is_normalised_to_token_ids() -> None:
    assert SamplingParams().logit_bias == {}
    assert SamplingParams(logit_bias={"50256": -100, 7: 2.5, " 12 ": 100}).logit_bias == {
        50256: -100.0,
        7: 2.5,
        12: 100.0,
    }


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        seed=0,
        logprobs=20,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.5,
    )
    assert SamplingParams(temperature=2, repetition_penalty=2).temperature == 2.0
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert params.top_k == 0  # -1 and 0 both mean off; one spelling downstream
    assert SamplingParams(logprobs=0).logprobs == 0


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy
