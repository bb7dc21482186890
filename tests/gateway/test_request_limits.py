"""Every field a request can make large is held to a limit: a 400 naming the field, the value and the flag."""

from __future__ import annotations

import argparse
import json

import pytest

from gateway.api_error import APIError
from gateway.openai.request import fit_to_context, parse_chat_request, parse_completion_request
from gateway.openai.request_limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    add_request_limit_args,
    request_limits,
)

MODELS = ["m"]
USER = [{"role": "user", "content": "hi"}]


def _chat(limits: RequestLimits = DEFAULT_LIMITS, **body):
    raw = json.dumps({"model": "m", "messages": USER, **body}).encode()
    return parse_chat_request(raw, MODELS, "hermes", limits)


def _completion(limits: RequestLimits = DEFAULT_LIMITS, **body):
    raw = json.dumps({"model": "m", "prompt": "hi", **body}).encode()
    return parse_completion_request(raw, MODELS, limits)


def _refused(call, **body) -> APIError:
    with pytest.raises(APIError) as caught:
        call(**body)
    assert caught.value.status == 400
    return caught.value


def _tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": function}


def test_defaults_serve_ordinary_requests():
    parsed = _chat(
        stop=["\n\n", "END"],
        logit_bias={str(t): -5 for t in range(300)},
        n=4,
        max_completion_tokens=1024,
        logprobs=True,
        top_logprobs=20,
        tools=[
            _tool(f"f{i}", {"type": "object", "properties": {"x": {"type": "string"}}}) for i in range(128)
        ],
        tool_choice="auto",
    )
    assert len(parsed.sampling.logit_bias) == 300 and parsed.sampling.n == 4
    assert _completion(structured_outputs={"regex": "[a-z]{1,8}"}).sampling.structured_outputs.regex


@pytest.mark.parametrize(
    "body, param, flag",
    [
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-strings"),
        ({"stop": ["ok", "x" * 257]}, "stop[1]", "--max-stop-string-chars"),
        ({"stop": "x" * 257}, "stop", "--max-stop-string-chars"),
        ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias", "--max-logit-bias"),
        (
            {"n": 32, "max_completion_tokens": 1025},
            "max_completion_tokens",
            "--max-request-completion-tokens",
        ),
        (
            {"n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 2000},
            "max_tokens",
            "--max-request-logprobs",
        ),
        ({"messages": USER * 2049}, "messages", "--max-messages"),
        ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools", "--max-tools"),
        (
            {"tools": [_tool("f", {"type": "object", "description": "x" * 33_000})]},
            "tools[0].function.parameters",
            "--max-tool-schema-bytes",
        ),
        ({"structured_outputs": {"regex": "[^a]*" * 820}}, "structured_outputs.regex", "--max-regex-chars"),
        ({"guided_regex": "a" * 4097}, "guided_regex", "--max-regex-chars"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
            "--max-grammar-bytes",
        ),
        (
            {"structured_outputs": {"choice": ["y" * 40_000, "z" * 40_000]}},
            "structured_outputs.choice",
            "--max-grammar-bytes",
        ),
    ],
)
def test_each_bound_is_a_400_naming_field_and_flag(body, param, flag):
    error = _refused(_chat, **body)
    assert error.param == param
    assert param in error.message and flag in error.message and "exceeds" in error.message


def test_a_tool_calls_constraint_is_held_to_the_grammar_limit_as_tools():
    tools = [_tool(f"f{i}", {"type": "object", "description": "d" * 1000}) for i in range(8)]
    limits = RequestLimits(max_grammar_bytes=4096)
    error = _refused(_chat, limits=limits, tools=tools, tool_choice="required")
    assert error.param == "tools" and "--max-grammar-bytes" in error.message
    assert (
        _chat(limits=limits, tools=tools, tool_choice="auto").tools is not None
    )  # no constraint: no grammar


def test_completions_are_held_to_the_same_bounds():
    assert _refused(_completion, stop=["a"] * 65).param == "stop"
    assert _refused(_completion, n=32, max_tokens=2048).param == "max_tokens"
    assert _refused(_completion, logprobs=20, max_tokens=20_000).param == "max_tokens"


def test_an_unset_max_tokens_shrinks_to_the_limits():
    limits = RequestLimits()
    parsed = _chat(n=32)
    assert fit_to_context(parsed, 10, 8192, limits).max_tokens == 1024
    parsed = _chat(n=2, logprobs=True, top_logprobs=20)
    assert fit_to_context(parsed, 10, 8192, limits).max_tokens == 256 * 1024 // (2 * 21)
    assert fit_to_context(_chat(), 10, 8192, limits).max_tokens == 8182  # only the context bounds n = 1


def test_limits_are_flags():
    parser = argparse.ArgumentParser()
    add_request_limit_args(parser)
    limits = request_limits(parser.parse_args(["--max-stop-strings", "4", "--max-logit-bias", "10"]))
    assert limits == RequestLimits(max_stop_strings=4, max_logit_bias=10)
    assert _refused(_chat, limits=limits, stop=["a", "b", "c", "d", "e"]).param == "stop"
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tools", "0"])
