"""OpenAI's fields on /v1/chat/completions and /v1/completions, checked once into one plain request: the body
(gateway/openai/body.py) and its output constraint (gateway/openai/output_constraint.py) are read by their own
modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from gateway.api_error import APIError, invalid_request
from gateway.openai.body import read_json_body, typed_field
from gateway.openai.messages import ChatMessage, parse_messages
from gateway.openai.output_constraint import constrain_to_call, constraint_field, structured_outputs_of
from gateway.openai.request_limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    check_constraint,
    check_logit_bias,
    check_max_tokens,
    check_messages,
    check_stop,
    check_tools,
    max_tokens_allowed,
)
from gateway.openai.tools import ToolCalling, parse_tool_calling
from shared.protocol import MAX_PRIORITY
from shared.sampling_params import MAX_PROMPT_LOGPROBS, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
)

Endpoint = Literal["chat", "completion"]

# SamplingParams fields that OpenAI names the same way; passed through so its checks (and messages) apply
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "ignore_eos",
    "repetition_penalty",
    "logit_bias",
    "n",  # choices: up to shared.sampling_params.MAX_N
)


@dataclass(slots=True)
class OpenAIRequest:
    endpoint: Endpoint
    model: str
    messages: list[ChatMessage] | None  # chat
    prompt: str | list[int] | None  # completions: text or token ids
    stream: bool
    include_usage: bool  # stream_options.include_usage
    max_tokens: int | None  # as asked; None lets fit_to_context choose
    sampling: SamplingParams  # validated; its max_tokens is final only after fit_to_context
    tools: ToolCalling | None = None  # chat: the tools the model may call (gateway/openai/tools.py)
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output's
    prompt_logprobs: int | None = None  # vLLM's extension as asked: top entries per prompt position
    constraint_field: str | None = None  # the field the output's constraint came from, for errors naming it
    # vLLM's extension: the order within the caller's tenant, lower first (tenants share by weight, not by this)
    priority: int = 0


def _model(body: dict, served_models: Collection[str]) -> str:
    model = body.get("model")
    if model is None and served_models:  # as vLLM: a single-model server need not be told which
        return next(iter(served_models))
    if model is not None and not isinstance(model, str):
        raise invalid_request(f"model must be a string, got {model!r}", "model")
    if model not in served_models:
        raise model_not_found(model, served_models)
    return model


def model_not_found(model: str | None, served_models: Collection[str]) -> APIError:
    """served_models: those the caller may use (an API key may be limited to some)."""
    served = ", ".join(served_models) or "none that this API key may use"
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it; this server serves {served}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def _refuse_unsupported(body: dict) -> None:
    """Features we do not serve are refused by name rather than silently ignored."""
    best_of = typed_field(body, "best_of", int, "an integer", 1)
    if best_of != 1:
        raise invalid_request("best_of other than 1 is not supported", "best_of")
    if typed_field(body, "suffix", str, "a string", ""):
        raise invalid_request("suffix is not supported", "suffix")
    for name in ("functions", "function_call"):  # OpenAI's deprecated form of tools and tool_choice
        if body.get(name) is not None:
            raise invalid_request(f"{name} is not supported: send tools and tool_choice instead", name)


def _sampling(
    body: dict,
    max_tokens: int | None,
    logprobs: int | None,
    renamed: dict[str, str],
    limits: RequestLimits,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams checks every value; its ValueError starts with the field, mapped back to the request's name.
    The fields whose size a client chooses are held to the limits first, before anything reads them whole."""
    check_stop(body.get("stop"), limits)
    check_logit_bias(body.get("logit_bias"), limits)
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    structured_outputs = structured_outputs_of(body)
    try:
        sampling = SamplingParams(
            max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
            **fields,
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].split("[", 1)[0]
        param = renamed.get(field, field)
        raise invalid_request(str(exc).replace(field, param, 1), param) from exc
    if max_tokens is not None:
        param = renamed.get("max_tokens", "max_tokens")
        check_max_tokens(max_tokens, sampling.n, sampling.logprobs, param, limits)
    return sampling


def _priority(body: dict) -> int:
    priority = typed_field(body, "priority", int, "an integer", 0)
    if abs(priority) > MAX_PRIORITY:
        raise invalid_request(f"priority must be within +-{MAX_PRIORITY}, got {priority}", "priority")
    return priority


def _common(body: dict, served_models: Collection[str]) -> tuple[str, bool, bool]:
    """model, stream, stream_options.include_usage: the same on both endpoints."""
    model = _model(body, served_models)
    _refuse_unsupported(body)
    typed_field(
        body, "user", str, "a string"
    )  # an end-user id OpenAI keeps for abuse reports; here only checked
    stream = typed_field(body, "stream", bool, "a boolean", False)
    options = typed_field(body, "stream_options", dict, "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid_request(
            "stream_options.include_usage must be a boolean", "stream_options.include_usage"
        )
    if options and not stream:
        raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
    return model, stream, include_usage


def parse_chat_request(
    raw: bytes,
    served_models: Collection[str],
    tool_call_parser: str | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> OpenAIRequest:
    """A /v1/chat/completions body; max_completion_tokens wins over the deprecated max_tokens, as in OpenAI.
    tool_call_parser: `--tool-call-parser`, without which tool_choice "auto" is refused."""
    return parse_chat_body(read_json_body(raw), served_models, tool_call_parser, limits)


def parse_chat_body(
    body: dict,
    served_models: Collection[str],
    tool_call_parser: str | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> OpenAIRequest:
    """parse_chat_request's checks on a body already read (the Responses API translates its own into one)."""
    model, stream, include_usage = _common(body, served_models)
    if "messages" not in body:
        raise invalid_request("messages is required", "messages")
    check_messages(body["messages"], limits)
    check_tools(body.get("tools"), limits)
    messages = parse_messages(body["messages"])
    renamed = {}
    max_tokens = typed_field(body, "max_tokens", int, "an integer")
    if body.get("max_completion_tokens") is not None:
        max_tokens = typed_field(body, "max_completion_tokens", int, "an integer")
        renamed["max_tokens"] = "max_completion_tokens"
    logprobs = None
    if typed_field(body, "logprobs", bool, "a boolean", False):
        logprobs = typed_field(body, "top_logprobs", int, "an integer", 0)
        renamed["logprobs"] = "top_logprobs"
    elif body.get("top_logprobs") is not None:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if body.get("echo") is not None:
        raise invalid_request("echo is served on /v1/completions only; see prompt_logprobs", "echo")
    prompt_logprobs = typed_field(body, "prompt_logprobs", int, "an integer")
    sampling = _sampling(body, max_tokens, logprobs, renamed, limits, prompt_logprobs)
    tools = parse_tool_calling(body, tool_call_parser)
    sampling = constrain_to_call(sampling, tools)
    field = "tools" if tools is not None and tools.constrained else constraint_field(body)
    check_constraint(sampling.structured_outputs, field, limits)
    return OpenAIRequest(
        "chat",
        model,
        messages,
        None,
        stream,
        include_usage,
        max_tokens,
        sampling,
        tools,
        prompt_logprobs=prompt_logprobs,
        constraint_field=field,
        priority=_priority(body),
    )


def _prompt(body: dict) -> str | list[int]:
    """One prompt, as text or token ids; a list of one is unwrapped, batches are refused."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_request("prompt must not be empty", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid_request("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _refuse_tools(body: dict) -> None:
    """A text completion has no messages to carry calls: tools are a chat feature, as in OpenAI."""
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise invalid_request(f"{name} is served on /v1/chat/completions only", name)


def parse_completion_request(
    raw: bytes, served_models: Collection[str], limits: RequestLimits = DEFAULT_LIMITS
) -> OpenAIRequest:
    """A /v1/completions body; logprobs here is the number of top alternatives, not a flag."""
    body = read_json_body(raw)
    model, stream, include_usage = _common(body, served_models)
    if "prompt" not in body:
        raise invalid_request("prompt is required", "prompt")
    prompt = _prompt(body)
    _refuse_tools(body)
    max_tokens = typed_field(body, "max_tokens", int, "an integer")
    logprobs = typed_field(body, "logprobs", int, "an integer")
    echo = typed_field(body, "echo", bool, "a boolean", False)
    prompt_logprobs = typed_field(body, "prompt_logprobs", int, "an integer")
    n = body.get("n")
    if echo and isinstance(n, int) and n > 1 and (logprobs is not None or max_tokens == 0):
        raise invalid_request(
            f"echo with logprobs or max_tokens 0 scores the prompt, which is served with n = 1, got n = {n}",
            "echo",
        )
    sampling = _sampling(
        body, max_tokens, logprobs, {}, limits, _prompt_scoring(echo, logprobs, max_tokens, prompt_logprobs)
    )
    field = constraint_field(body)
    check_constraint(sampling.structured_outputs, field, limits)
    return OpenAIRequest(
        "completion",
        model,
        None,
        prompt,
        stream,
        include_usage,
        max_tokens,
        sampling,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        constraint_field=field,
        priority=_priority(body),
    )


def _prompt_scoring(
    echo: bool, logprobs: int | None, max_tokens: int | None, asked: int | None
) -> int | None:
    """The top entries per prompt position the executor computes: what prompt_logprobs asks, and with echo what
    logprobs asks of the prompt's tokens too; echo with max_tokens 0 scores the prompt even without logprobs
    (a cheap pass), since scoring is how the executor serves a request that generates nothing."""
    if asked is not None and not 0 <= asked <= MAX_PROMPT_LOGPROBS:
        return asked  # SamplingParams refuses it by name
    wanted = [] if asked is None else [asked]
    if echo and logprobs is not None and 0 <= logprobs <= MAX_PROMPT_LOGPROBS:  # else logprobs is refused
        wanted.append(logprobs)
    if echo and max_tokens == 0 and not wanted:
        wanted.append(0)
    return max(wanted, default=None)


def fit_to_context(
    request: OpenAIRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> SamplingParams:
    """The final SamplingParams: an explicit max_tokens must fit beside the prompt; a default shrinks to fit it
    and the per-request limits."""
    room = max_model_len - num_prompt_tokens
    wanted = request.max_tokens
    if wanted is None:
        default = room if request.endpoint == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
        sampling = request.sampling
        wanted = min(default, room, max_tokens_allowed(sampling.n, sampling.logprobs, limits))
    if room < 1 or wanted > room:
        where = "messages" if request.endpoint == "chat" else "prompt"
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max(wanted, 1)} tokens ({num_prompt_tokens} in the {where}, {max(wanted, 1)} "
            f"in the completion). Please reduce the length of the {where} or completion.",
            "invalid_request_error",
            where,
            "context_length_exceeded",
        )
    return dataclasses.replace(request.sampling, max_tokens=wanted)
