"""The prompt carries the tools: the model's template when it renders them, else kvserve's Hermes ChatML template;
assistant tool calls and tool results in the conversation; `--chat-template PATH`."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from gateway.api_error import APIError
from gateway.openai.messages import parse_messages
from gateway.prompt.chat_template import HERMES_TOOL_TEMPLATE, chat_prompt_token_ids, read_chat_template
from tests.gateway.tool_examples import WEATHER

TOOLS = [WEATHER]
TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def rendered(tokenizer, conversation, tools=None) -> str:
    return tokenizer.decode(chat_prompt_token_ids(tokenizer, parse_messages(conversation), tools))


def test_tools_reach_a_chatml_model_without_tools_through_the_hermes_template(tokenizer):
    text = rendered(tokenizer, TWO_TURNS[:2], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # without tools, the model's own template, its default system prompt and all
    assert "SmolLM" in rendered(tokenizer, TWO_TURNS[1:2]) and "SmolLM" not in text


def test_a_two_turn_tool_conversation_renders_the_call_and_its_result(tokenizer):
    text = rendered(tokenizer, TWO_TURNS, TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    # a conversation holding calls uses the tool template even when this turn offers no tools
    assert '<tool_call>\n{"name": "get_weather"' in rendered(tokenizer, TWO_TURNS)


def test_the_hermes_template_renders_as_transformers_renders_it(tokenizer, default_model):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(default_model)
    conversation = [
        {key: value for key, value in dataclasses.asdict(m).items() if value is not None}
        for m in parse_messages(TWO_TURNS)
    ]
    template = HERMES_TOOL_TEMPLATE.read_text()
    expected = reference.apply_chat_template(
        conversation, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert rendered(tokenizer, TWO_TURNS, TOOLS) == expected


def test_tool_messages_keep_their_call_id_and_get_the_function_name():
    messages = parse_messages(TWO_TURNS)
    assert messages[2].content == "" and messages[2].tool_calls == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert (messages[3].tool_call_id, messages[3].name) == ("call_1", "get_weather")


def test_a_model_template_that_renders_tools_is_used_as_it_is(tokenizer):
    own = copy.copy(tokenizer)
    own.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    )
    own._templates = {}
    assert own.decode(chat_prompt_token_ids(own, parse_messages(TWO_TURNS[1:2]), TOOLS)) == (
        "[get_weather]Weather in Paris?"
    )


def test_a_model_template_without_tools_that_is_not_chatml_is_400(tokenizer):
    other = copy.copy(tokenizer)
    other.chat_template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    other._templates = {}
    with pytest.raises(APIError) as info:
        chat_prompt_token_ids(other, parse_messages(TWO_TURNS[1:2]), TOOLS)
    assert (info.value.status, info.value.param) == (400, "tools") and "--chat-template" in info.value.message


@pytest.mark.parametrize(
    "tool_calls, param, message",
    [
        ("call", "messages[0].tool_calls", "must be a list"),
        ([{"type": "function"}], "messages[0].tool_calls[0]", "{type: 'function'"),
        (
            [{"type": "function", "function": {"name": 1}}],
            "messages[0].tool_calls[0].function.name",
            "string",
        ),
        (
            [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
            "messages[0].tool_calls[0].function.arguments",
            "the text of a JSON object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
            "messages[0].tool_calls[0].function.arguments",
            "the text of a JSON object",
        ),
        ([{"id": 5, "function": {"name": "f", "arguments": "{}"}}], "messages[0].tool_calls[0].id", "string"),
    ],
)
def test_bad_assistant_tool_calls_are_400_naming_the_field(tool_calls, param, message):
    with pytest.raises(APIError) as info:
        parse_messages([{"role": "assistant", "content": None, "tool_calls": tool_calls}])
    assert (info.value.status, info.value.param) == (400, param) and message in info.value.message


def test_a_tool_call_id_must_be_a_string():
    with pytest.raises(APIError) as info:
        parse_messages([{"role": "tool", "content": "x", "tool_call_id": 3}])
    assert info.value.param == "messages[0].tool_call_id"


def test_chat_template_flag_reads_a_jinja_file(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(good)).startswith("{% for")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="bad.jinja is not a Jinja template"):
        read_chat_template(str(bad))
    with pytest.raises(ValueError, match="missing.jinja cannot be read"):
        read_chat_template(str(tmp_path / "missing.jinja"))
