from __future__ import annotations

import pytest

from gateway.api_error import APIError
from gateway.openai.messages import ChatMessage, parse_messages
from gateway.prompt.chat_template import chat_prompt_token_ids


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
