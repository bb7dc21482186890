from __future__ import annotations

import pytest

from gateway.api_error import APIError
from gateway.openai.messages import ChatMessage, parse_messages
from gateway.prompt.chat_template import HERMES_TOOL_TEMPLATE, chat_prompt_token_ids, choose_tool_call_parser


def test_prompt_ends_with_the_assistant_turn_opened(tokenizer):
    messages = parse_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    ids = chat_prompt_token_ids(tokenizer, messages)
    text = tokenizer.decode(ids)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == tokenizer.backend_tokenizer.token_to_id(
        "<|im_start|>"
    )  # a special token, not its characters
    assert ids.count(ids[0]) == 3


def test_matches_the_tokenizers_own_rendering(tokenizer):
    conversation = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "{}"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "3+3?"}]},
    ]
    expected = [dict(m) for m in conversation]
    expected[3]["content"] = "and 3+3?"
    rendered = tokenizer.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert chat_prompt_token_ids(tokenizer, parse_messages(conversation)) == tokenizer.encode(
        rendered, add_special_tokens=False
    )


def test_default_system_prompt_added_by_template(tokenizer):
    text = tokenizer.decode(chat_prompt_token_ids(tokenizer, [ChatMessage("user", "x")]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_assistant_without_content_is_empty_text():
    assert parse_messages([{"role": "assistant", "content": None}]) == [ChatMessage("assistant", "")]


def test_tokenizer_without_template_is_400(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(APIError) as info:
        chat_prompt_token_ids(NoTemplate(), [ChatMessage("user", "x")])
    assert info.value.status == 400 and "no chat template" in info.value.message


# a Qwen-like template: it renders the tools and asks for Hermes <tool_call> tags
HERMES_TAGS = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Answer with <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
# a Llama-3.1-like template: it renders the tools and asks for bare JSON, which kvserve has no parser for
BARE_JSON = (
    "{% if tools %}Call one of {{ tools | tojson }} by answering with its JSON.{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}{% endfor %}"
)
NOT_CHATML = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>{% endfor %}"


def test_the_parser_follows_the_tool_call_tags_the_template_implies(tokenizer):
    assert choose_tool_call_parser(None, HERMES_TAGS) == (
        "hermes",
        "the chat template writes tool calls in <tool_call> tags",
    )
    assert choose_tool_call_parser(None, {"default": NOT_CHATML, "tool_use": HERMES_TAGS})[0] == "hermes"
    # the default model's ChatML template renders no tools: requests with tools get kvserve's Hermes template
    parser, why = choose_tool_call_parser(None, tokenizer.chat_template)
    assert parser == "hermes" and "Hermes template" in why
    assert "<tool_call>" in HERMES_TOOL_TEMPLATE.read_text()  # the tags that choice counts on


def test_a_template_without_hermes_calls_gets_no_parser():
    assert choose_tool_call_parser(None, BARE_JSON) == (
        None,
        "the chat template renders tools but its calls are not in <tool_call> tags, all kvserve reads",
    )
    parser, why = choose_tool_call_parser(None, NOT_CHATML)
    assert parser is None and "not ChatML" in why
    assert choose_tool_call_parser(None, None) == (None, "the model has no chat template")
    parser, why = choose_tool_call_parser(None, "{% for m in messages %}")
    assert parser is None and why.startswith("the chat template does not parse: line 1")


def test_the_flag_overrides_the_template(tokenizer):
    assert choose_tool_call_parser("none", tokenizer.chat_template) == (None, "--tool-call-parser none")
    assert choose_tool_call_parser("none", HERMES_TAGS)[0] is None
    assert choose_tool_call_parser("hermes", BARE_JSON) == ("hermes", "--tool-call-parser hermes")
