"""The bounds on what one request may ask for: every field a client can make large, refused with a 400 naming it.

A tenant's request costs the others through what it makes the gateway and executor do per token and per step
(stop strings matched, logit_bias entries applied, logprobs serialised, grammars compiled, messages templated),
so each of those has a limit here, set by a gateway flag. The defaults serve real clients: OpenAI's own limits
where it has one (300 logit_bias entries, 128 tools), and room for long agent conversations elsewhere.
Unset max_tokens shrinks to fit the per-request limits; an explicit one that breaks them is refused.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from gateway.api_error import invalid_request
from gateway.limit_flags import add_limit_flags, read_limit_flags
from shared.structured_outputs import StructuredOutputsParams


@dataclass(slots=True, frozen=True)
class RequestLimits:
    max_stop_strings: int = 64  # OpenAI allows 4; vLLM sets none; each is matched on every token
    max_stop_string_chars: int = 256
    max_logit_bias: int = 300  # OpenAI's limit; each entry is applied on every step
    max_messages: int = 2048
    max_tools: int = 128  # OpenAI's limit
    max_tool_schema_bytes: int = 32 * 1024  # one function's parameters, as JSON
    max_regex_chars: int = 4096  # compile work grows faster than the regex: the executor has a deadline too
    max_grammar_bytes: int = 64 * 1024  # a JSON schema, an EBNF grammar or the choices, as sent
    # n x max_tokens: the sequences and steps one request may hold
    max_completion_tokens: int = 32 * 1024
    # n x (top_logprobs + 1) x max_tokens: what the gateway serialises for one request
    max_logprob_entries: int = 256 * 1024


DEFAULT_LIMITS = RequestLimits()

_FLAGS = {
    "max_stop_strings": ("--max-stop-strings", "stop strings one request may give"),
    "max_stop_string_chars": ("--max-stop-string-chars", "characters of one stop string"),
    "max_logit_bias": ("--max-logit-bias", "logit_bias entries one request may give"),
    "max_messages": ("--max-messages", "messages of one chat request"),
    "max_tools": ("--max-tools", "tools of one chat request"),
    "max_tool_schema_bytes": ("--max-tool-schema-bytes", "bytes of one tool's parameters schema (JSON)"),
    "max_regex_chars": ("--max-regex-chars", "characters of a structured-output regex"),
    "max_grammar_bytes": (
        "--max-grammar-bytes",
        "bytes of a structured output's JSON schema, grammar or choices (tool calls' schemas too)",
    ),
    "max_completion_tokens": (
        "--max-request-completion-tokens",
        "n x max_tokens of one request (an unset max_tokens shrinks to fit)",
    ),
    "max_logprob_entries": (
        "--max-request-logprobs",
        "n x (top_logprobs + 1) x max_tokens of one request (an unset max_tokens shrinks to fit)",
    ),
}


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    title = "per-request limits (a request over one gets a 400 naming the field)"
    add_limit_flags(parser, title, DEFAULT_LIMITS, _FLAGS)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return read_limit_flags(RequestLimits, args)


def _over(param: str, what: str, got: int, limit: int, field: str) -> None:
    if got > limit:
        flag = _FLAGS[field][0]
        raise invalid_request(f"{param}: {what} {got} exceeds this server's limit of {limit} ({flag})", param)


def check_stop(stop: object, limits: RequestLimits) -> None:
    """Before SamplingParams reads them: a list of a million strings is refused by its length alone."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _over("stop", "the number of stop strings", len(stops), limits.max_stop_strings, "max_stop_strings")
    for i, text in enumerate(stops):
        if isinstance(text, str):
            param = "stop" if isinstance(stop, str) else f"stop[{i}]"
            _over(
                param,
                "a stop string's length",
                len(text),
                limits.max_stop_string_chars,
                "max_stop_string_chars",
            )


def check_logit_bias(logit_bias: object, limits: RequestLimits) -> None:
    if isinstance(logit_bias, dict):
        _over("logit_bias", "the number of entries", len(logit_bias), limits.max_logit_bias, "max_logit_bias")


def check_messages(messages: object, limits: RequestLimits) -> None:
    if isinstance(messages, list):
        _over("messages", "the number of messages", len(messages), limits.max_messages, "max_messages")


def check_tools(tools: object, limits: RequestLimits) -> None:
    """Count, then each function's parameters schema by its JSON size (what templating and a constraint cost)."""
    if not isinstance(tools, list):
        return
    _over("tools", "the number of tools", len(tools), limits.max_tools, "max_tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        if parameters is not None:
            size = len(json.dumps(parameters, ensure_ascii=False).encode())
            param = f"tools[{i}].function.parameters"
            _over(
                param,
                "the schema's size in bytes",
                size,
                limits.max_tool_schema_bytes,
                "max_tool_schema_bytes",
            )


def constraint_size(spec: StructuredOutputsParams) -> int:
    """What a grammar compiles from: characters of a regex, bytes of a schema, grammar or the choices."""
    if spec.kind == "regex":
        return len(spec.regex)
    if spec.kind == "choice":
        return sum(len(choice.encode()) for choice in spec.choice)
    value = spec.json if spec.kind == "json" else spec.grammar if spec.kind == "grammar" else ""
    return len(value.encode())


def check_constraint(spec: StructuredOutputsParams | None, param: str | None, limits: RequestLimits) -> None:
    """param: the request's field the constraint came from (tools, for a required or named tool call)."""
    if spec is None:
        return
    if spec.kind == "regex":
        _over(param, "the regex's length", constraint_size(spec), limits.max_regex_chars, "max_regex_chars")
    else:
        _over(
            param, "its size in bytes", constraint_size(spec), limits.max_grammar_bytes, "max_grammar_bytes"
        )


def max_tokens_allowed(n: int, logprobs: int | None, limits: RequestLimits) -> int:
    """The most max_tokens a request with n choices and these top logprobs may ask for."""
    allowed = limits.max_completion_tokens // n
    if logprobs is not None:
        allowed = min(allowed, limits.max_logprob_entries // (n * (logprobs + 1)))
    return max(allowed, 1)


def check_max_tokens(
    max_tokens: int, n: int, logprobs: int | None, param: str, limits: RequestLimits
) -> None:
    """An explicit max_tokens against n x max_tokens and the logprob entries the request would make."""
    if n * max_tokens > limits.max_completion_tokens:
        raise invalid_request(
            f"{param}: n {n} x {param} {max_tokens} = {n * max_tokens} exceeds this server's limit of "
            f"{limits.max_completion_tokens} completion tokens per request (--max-request-completion-tokens)",
            param,
        )
    if logprobs is not None and n * (logprobs + 1) * max_tokens > limits.max_logprob_entries:
        entries = n * (logprobs + 1) * max_tokens
        raise invalid_request(
            f"{param}: n {n} x (top logprobs {logprobs} + 1) x {param} {max_tokens} = {entries} logprob entries "
            f"exceeds this server's limit of {limits.max_logprob_entries} per request (--max-request-logprobs)",
            param,
        )
