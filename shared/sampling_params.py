"""How one request wants its tokens chosen: vLLM's SamplingParams, checked once at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
# top entries per prompt position: each position's logprobs cross the wire, so a request's size grows with it
MAX_PROMPT_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value is [-100, 100]
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_REPETITION_PENALTY = 2.0  # SGLang's range is [0, 2]; 0 would divide by zero here, so (0, 2]
# choices one request may ask for (OpenAI allows 128, vLLM sets no bound): each is a sequence of its own in the
# executor's batch, so a few dozen already fill a CPU step; an executor also refuses n above its --max-num-seqs
MAX_N = 32


def _integer(name: str, value: object) -> int:
    """Rejects bools and strings too, so a JSON `true` or `"16"` never passes as a count; and integers past 64
    bits, which neither the wire (msgpack) nor torch's generators take."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value


def _number(name: str, value: object) -> float:
    """Accepts ints as floats (JSON has one number type) but never NaN or infinity, which defeat range checks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if isinstance(value, int) and not -(2**1023) < value < 2**1023:  # float() would overflow
        raise ValueError(f"{name} must be a finite number, got an integer too large for a float")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _list(name: str, value: object) -> list:
    """A missing list means an empty one, so consumers never branch on None."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _logit_bias(value: object) -> dict[int, float]:
    """{token id: bias}; JSON objects have string keys, so "50256" is token 50256."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token ids to biases, got {value!r}")
    bias = {}
    for key, amount in value.items():
        token = key
        if isinstance(key, str) and key.strip().isdecimal():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        amount = _number(f"logit_bias[{key}]", amount)
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {amount}")
        bias[token] = amount
    return bias


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; normalised to 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs besides the chosen token's; 0 = only the chosen one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # added to the logits before penalties; normalised to a dict
    # the output must match this (shared/structured_outputs.py); a dict (the wire's form) is read into one
    structured_outputs: StructuredOutputsParams | dict | None = None
    # vLLM's: the logprob of every prompt token (the first has none) and this many top entries per position
    prompt_logprobs: int | None = None
    # choices sampled from the one prompt (parallel sampling: the prompt's KV blocks are shared between them)
    n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= _integer("n", self.n) <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        wants_prompt = self.prompt_logprobs is not None
        if wants_prompt and not 0 <= _integer("prompt_logprobs", self.prompt_logprobs) <= MAX_PROMPT_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if wants_prompt and self.n > 1:  # the prompt is one, scored once: ask it of one choice
            raise ValueError(f"prompt_logprobs is served with n = 1, got n = {self.n}")
        # max_tokens 0 scores the prompt without generating, which only prompt logprobs can report
        least = 0 if self.prompt_logprobs is not None else 1
        if _integer("max_tokens", self.max_tokens) < least:
            raise ValueError(
                f"max_tokens must be at least {least}, got {self.max_tokens}"
                + ("" if least == 0 else " (0 only scores the prompt: with prompt_logprobs, or echo)")
            )
        self.temperature = _number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _integer("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or at least 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _integer("seed", self.seed)
        # OpenAI allows one stop string or a list; an empty one would end every output at once.
        stop = [self.stop] if isinstance(self.stop, str) else _list("stop", self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        token_ids = _list("stop_token_ids", self.stop_token_ids)
        self.stop_token_ids = [_integer(f"stop_token_ids[{i}]", t) for i, t in enumerate(token_ids)]
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None and not 0 <= _integer("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
            )
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_wire(self.structured_outputs)

    def choice_seed(self, index: int) -> int | None:
        """Choice index's seed: the request's own for the first (so n=1 and choice 0 agree), then seed + index as
        vLLM derives them, so a seeded request is reproducible and its choices differ."""
        return None if self.seed is None else self.seed + index

    @property
    def greedy(self) -> bool:
        """Greedy rows skip the random draw and take the argmax."""
        return self.temperature == 0 or self.top_k == 1
