"""tools and tool_choice on /v1/chat/completions: shapes checked (400 naming the field) and the schema that
constrains tool_choice "required" or a named function to one valid call."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from gateway.api_error import APIError
from gateway.openai.request import parse_chat_request, parse_completion_request
from gateway.openai.tools import call_schema
from tests.gateway.tool_examples import ADOPT, TIME, WEATHER

MODELS = ["m"]


def chat(parser: str | None = "hermes", **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode(), MODELS, parser)


def error_of(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        chat(**fields)
    return info.value


def test_auto_is_the_default_with_tools_and_leaves_the_output_unconstrained():
    request = chat(tools=[WEATHER, TIME])
    assert request.tools.choice == "auto" and request.tools.names == ["get_weather", "get_time"]
    assert request.sampling.structured_outputs is None
    assert request.tools.tools[1] == TIME  # what the chat template renders


def test_auto_needs_a_tool_call_parser_as_vllm_does():
    with pytest.raises(APIError) as info:
        chat(parser=None, tools=[WEATHER])
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    assert "--tool-call-parser hermes" in info.value.message
    # the constrained choices need no parser: the output is the call's JSON itself
    assert chat(parser=None, tools=[WEATHER], tool_choice="required").tools.choice == "required"


def test_none_and_no_tools_mean_plain_text():
    assert chat(tools=[WEATHER], tool_choice="none").tools is None
    assert chat(parser=None, tools=[WEATHER], tool_choice="none").tools is None
    assert chat(tool_choice="auto").tools is None and chat(tools=[]).tools is None


def test_named_function_is_constrained_to_one_call_of_it():
    request = chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert (request.tools.choice, request.tools.function) == ("function", "get_weather")
    schema = json.loads(request.sampling.structured_outputs.json)
    assert schema == call_schema(WEATHER["function"])
    # "name" before "arguments" in the schema's text, so the name is written first
    assert list(schema["properties"]) == ["name", "arguments"]
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    for wrong in (
        {"name": "get_time", "arguments": {}},
        {"name": "get_weather", "arguments": {"unit": "c"}},  # city is required
        {"name": "get_weather"},
        {"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_required_is_constrained_to_a_call_of_any_tool():
    schema = json.loads(chat(tools=[WEATHER, TIME], tool_choice="required").sampling.structured_outputs.json)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}, schema)
    for wrong in ({"name": "get_date", "arguments": {}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


@pytest.mark.parametrize("tools", [[ADOPT], [WEATHER, ADOPT]], ids=["alone", "in-anyof"])
def test_parameters_referring_to_their_own_defs_still_resolve_inside_the_call(tools):
    tools = copy.deepcopy(tools)
    parameters = tools[-1]["function"]["parameters"]  # and to their own root
    parameters["properties"]["owners"] = {"type": "array", "items": {"$ref": "#"}}
    schema = json.loads(chat(tools=tools, tool_choice="required").sampling.structured_outputs.json)
    pet = {"name": "Rex", "kind": "dog"}
    jsonschema.validate({"name": "adopt", "arguments": {"pet": pet}}, schema)
    jsonschema.validate({"name": "adopt", "arguments": {"pet": pet, "owners": [{"pet": pet}]}}, schema)
    for wrong in ({"pet": {"name": "Rex"}}, {"pet": pet, "owners": [{"pet": {"kind": "cat"}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "adopt", "arguments": wrong}, schema)
    assert parameters["properties"]["pet"] == {"$ref": "#/$defs/Pet"}  # the request's own left as sent


def test_a_single_tool_required_is_its_call_without_anyof():
    schema = json.loads(chat(tools=[WEATHER], tool_choice="required").sampling.structured_outputs.json)
    assert schema == call_schema(WEATHER["function"])


def test_parallel_tool_calls_false_allows_one_call():
    assert chat(tools=[WEATHER]).tools.parallel
    assert not chat(tools=[WEATHER], parallel_tool_calls=False).tools.parallel


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
        ({"tools": ["f"]}, "tools[0]", "must be an object"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object with a name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1-64"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name", "1-64"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
            "must be a string",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
            "of an object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "of an object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "must be a boolean",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name", "a string"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "'get_time', which is not in tools (given: get_weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice.function.name",
            "not in tools (given: none)",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
        ({"function_call": "auto"}, "function_call", "send tools and tool_choice instead"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(fields, param, message):
    error = error_of(**fields)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert message in error.message


UNHELD = {  # a tool whose parameters use a keyword the grammar library would not hold
    "type": "function",
    "function": {"name": "tag", "parameters": {"type": "object", "properties": {"t": {"uniqueItems": True}}}},
}


def test_a_constrained_tools_unheld_keyword_is_400_naming_its_parameters():
    for choice in ["required", {"type": "function", "function": {"name": "tag"}}]:
        error = error_of(tools=[WEATHER, UNHELD], tool_choice=choice)
        assert (error.status, error.param) == (400, "tools[1].function.parameters")
        assert error.message.startswith(
            "tools[1].function.parameters uses uniqueItems at /properties/t (distinct array items)"
        )
    # held to WEATHER's schema only, or to none: the other tool's schema goes to the prompt alone
    named = chat(
        tools=[WEATHER, UNHELD], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert named.constraint_field == "tools"
    assert chat(tools=[WEATHER, UNHELD]).tools.choice == "auto"


@pytest.mark.parametrize("field", ["tools", "tool_choice"])
def test_completions_refuse_tools_by_name(field):
    body = {"model": "m", "prompt": "hi", field: [WEATHER] if field == "tools" else "auto"}
    with pytest.raises(APIError) as info:
        parse_completion_request(json.dumps(body).encode(), MODELS)
    assert (info.value.status, info.value.param) == (400, field)
    assert "/v1/chat/completions only" in info.value.message
