"""Tool calling through the real stack (the shared default_model_stack: Redis, an executor with the default model,
gateways) with the `openai` client, and an OpenAI Agents SDK agent's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from gateway.openai.messages import parse_messages
from gateway.prompt.chat_template import chat_prompt_token_ids
from gateway.prompt.tokenizer import Tokenizer
from tests.gateway.tool_examples import ADOPT, TIME, WEATHER

TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a --chat-template of the test's own that renders tools (so it is used as it is)
OWN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}TOOLS: {{ tools | map(attribute='function.name') | join(', ') }}\n{% endif %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def servers(default_model_stack, tmp_path_factory):
    """(a client of the default gateway, whose parser the default model's template makes hermes, a client of one
    with --chat-template OWN_TEMPLATE, started for this module: that template renders tools but no <tool_call>
    tags, so it gets no parser)."""
    template = tmp_path_factory.mktemp("tools-stack") / "own.jinja"
    template.write_text(OWN_TEMPLATE)
    own = default_model_stack.add_gateway("--chat-template", str(template), name="gateway-own-template")
    yield [
        openai.OpenAI(base_url=f"{g.base}/v1", api_key="none", timeout=120, max_retries=0)
        for g in (default_model_stack.gateways[1], own)
    ]
    default_model_stack.remove(own)


@pytest.fixture
def client(servers) -> openai.OpenAI:
    return servers[0]


def streamed_answer(stream) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat, assembled as a client does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or ():
            call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
            if entry.id is not None:
                assert call["id"] is None and entry.type == "function", "id, type and name come once, first"
                call["id"], call["name"] = entry.id, entry.function.name
            call["arguments"] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def whole_answer(response) -> tuple[str, list[dict], str]:
    choice = response.choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or ()
    ]
    return choice.message.content or "", calls, choice.finish_reason


def assert_valid_calls(calls: list[dict], names: list[str]) -> None:
    assert calls, "no tool call"
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {}) for tool in [*TOOLS, ADOPT]}
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def chat(client, stream: bool, **fields) -> tuple[str, list[dict], str]:
    fields = {"model": "tiny", "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 64} | fields
    if stream:
        return streamed_answer(client.chat.completions.create(stream=True, **fields))
    return whole_answer(client.chat.completions.create(**fields))


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_a_call_valid_against_its_tools_schema(client, stream):
    content, calls, finish = chat(client, stream, tool_choice="required")
    assert_valid_calls(calls, ["get_weather", "get_time"])
    assert finish == "tool_calls" and content == ""


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_gives_a_call_of_it(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = chat(client, stream, tool_choice=named)
    assert_valid_calls(calls, ["get_time"])
    assert finish == "tool_calls" and len(calls) == 1


def test_a_two_turn_conversation_from_a_required_call(client):
    content, calls, _ = chat(client, False, tool_choice="required")
    assert_valid_calls(calls, ["get_weather", "get_time"])
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ],
    }
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C and sunny"}
    answer = client.chat.completions.create(
        model="tiny",
        messages=[*ASK, turn, result],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=24,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_two_turn_conversation_carries_the_call_and_its_result_into_the_prompt(client, default_model):
    """The second turn of an agent loop: the assistant's call and the tool's result reach the prompt (its
    length is the Hermes template's rendering of them) and the model answers in OpenAI's shape."""
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=16
    )
    tokenizer = Tokenizer.from_dir(default_model)
    expected = chat_prompt_token_ids(tokenizer, parse_messages(messages), TOOLS)
    assert answer.usage.prompt_tokens == len(expected)
    assert "18 C and sunny" in tokenizer.decode(expected)
    content, calls, finish = whole_answer(answer)
    assert finish in {"stop", "length", "tool_calls"}
    assert "<tool_call>" not in content
    if calls:
        assert_valid_calls(calls, ["get_weather", "get_time"])


@pytest.mark.slow
def test_auto_streamed_is_the_whole_answer_and_never_leaks_the_tags(client):
    """Greedy, so the same output twice: what the stream assembles is what the whole answer says. (The default
    model answers this in text; tests/gateway/test_tool_responses.py streams a Hermes call's real tokens.)"""
    whole = chat(client, False, tool_choice="auto", max_tokens=32)
    streamed = chat(client, True, tool_choice="auto", max_tokens=32)
    assert "<tool_call>" not in whole[0] and "</tool_call>" not in whole[0]
    assert (streamed[0], [(c["name"], c["arguments"]) for c in streamed[1]], streamed[2]) == (
        whole[0],
        [(c["name"], c["arguments"]) for c in whole[1]],
        whole[2],
    )


def _earlier_call(i: int, city: str) -> dict:
    arguments = json.dumps({"city": city})
    function = {"name": "get_weather", "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": function}],
    }


# two earlier turns answered with calls: the default model then writes a Hermes <tool_call> of its own (greedy)
TWO_SHOT = [
    {"role": "user", "content": "Weather in Oslo?"},
    _earlier_call(1, "Oslo"),
    {"role": "user", "content": "Weather in Rome?"},
    _earlier_call(2, "Rome"),
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_the_model_writes_itself(client, stream):
    content, calls, finish = chat(client, stream, messages=TWO_SHOT, tool_choice="auto")
    assert_valid_calls(calls, ["get_weather"])
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls" and "tool_call" not in content


def test_chat_template_flag_replaces_the_models_template(servers, default_model):
    _, own = servers
    answer = own.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=1
    )
    tokenizer = Tokenizer.from_dir(default_model)
    tokenizer.chat_template = OWN_TEMPLATE
    text = tokenizer.decode(chat_prompt_token_ids(tokenizer, parse_messages(ASK), TOOLS))
    assert text.endswith("TOOLS: get_weather, get_time\n<|im_start|>assistant")  # jinja drops a last newline
    assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_bad_tool_requests_are_400_naming_the_field(servers):
    client, plain = servers
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, False, tool_choice={"type": "function", "function": {"name": "get_date"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as info:
        chat(plain, False)  # tools, so "auto", on a gateway whose template implies no parser
    assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, False, tools=[{"type": "function", "function": {"name": "has space"}}])
    assert info.value.body["param"] == "tools[0].function.name"


def test_a_tool_of_nested_models_gives_a_call_valid_against_its_defs(client):
    named = {"type": "function", "function": {"name": "adopt"}}
    ask = [{"role": "user", "content": "Adopt a dog called Rex."}]
    content, calls, finish = chat(client, False, messages=ask, tools=[WEATHER, ADOPT], tool_choice=named)
    assert_valid_calls(calls, ["adopt"])
    assert finish == "tool_calls"


def test_a_tool_schema_the_executor_cannot_compile_is_a_400_naming_tools(client):
    bad = {
        "type": "function",
        "function": {"name": "bad", "parameters": {"properties": {"a": {"$ref": "#/x"}}}},
    }
    for choice in ["required", {"type": "function", "function": {"name": "bad"}}]:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, False, tools=[bad], tool_choice=choice)
        assert info.value.body["param"] == "tools"
        message = info.value.body["message"]
        assert message.startswith(
            "tools: a function's parameters schema cannot be enforced: Cannot find field 'x'"
        )
    assert chat(client, False, tool_choice="required")[2] == "tool_calls"  # the next request is served


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"18 C and sunny in {city}"


async def _run_agent(base: str, api: str) -> list[tuple[dict, int]]:
    """An Agents SDK agent with one function tool, run against the gateway at `base` through `api` (the SDK's
    default is "responses"); returns each model request's body and its answer's status. The first turn is held
    to a call (tool_choice "required": a 135M model need not choose one); once the tool has run, the SDK's
    default reset_tool_choice drops that, so the next turn sends the tool's result with tools and "auto"."""
    exchanges: list[tuple[dict, int]] = []

    async def record(response: httpx.Response) -> None:
        exchanges.append((json.loads(response.request.content), response.status_code))

    async with httpx.AsyncClient(timeout=120, event_hooks={"response": [record]}) as http:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", http_client=http, max_retries=0)
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="weather",
            instructions="Answer briefly.",
            tools=[get_weather],
            model=model_class(model="tiny", openai_client=client),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        )
        # a model that goes on calling its tool (under "auto") is the model's choice, not the protocol's
        with contextlib.suppress(MaxTurnsExceeded):
            await Runner.run(
                agent,
                "What is the weather in Paris?",
                max_turns=3,
                run_config=RunConfig(tracing_disabled=True),
            )
    return exchanges


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_agent_runs_its_tool_against_a_default_gateway(default_model_stack, api):
    """The gateway started without --tool-call-parser (as `kvserve up` starts it) serves the agent's loop."""
    exchanges = asyncio.run(_run_agent(default_model_stack.gateways[1].base, api))
    assert [status for _, status in exchanges] == [200] * len(exchanges) and len(exchanges) >= 2
    first, then = exchanges[0][0], exchanges[1][0]
    assert first["tool_choice"] == "required"
    assert then["tools"] and then.get("tool_choice", "auto") == "auto"
    results = then["input"] if api == "responses" else then["messages"]
    sent = [
        item for item in results if item.get("type") == "function_call_output" or item.get("role") == "tool"
    ]
    assert len(sent) == 1 and sent[0].get("output", sent[0].get("content")).startswith("18 C and sunny in ")


def test_an_agents_sdk_loop_is_refused_where_auto_is_turned_off(default_model_stack):
    """--tool-call-parser none: the agent's second turn is the 400 that names how to turn "auto" on."""
    with pytest.raises(openai.BadRequestError) as refused:
        asyncio.run(_run_agent(default_model_stack.gateways[0].base, "chat_completions"))
    assert refused.value.body["param"] == "tool_choice"
    assert "--tool-call-parser hermes" in refused.value.body["message"]
