from __future__ import annotations

import json

import pytest

from gateway.api_error import APIError
from gateway.openai.request import parse_chat_request, parse_completion_request
from gateway.prompt.token_ids import prompt_token_ids

MODELS = ("m",)


def test_text_prompt_is_encoded_as_the_offline_api_does(tokenizer):
    request = parse_completion_request(json.dumps({"prompt": "Hello there"}).encode(), MODELS)
    assert prompt_token_ids(request, tokenizer) == tokenizer.encode("Hello there")


def test_token_id_prompt_passes_through_and_is_range_checked(tokenizer):
    request = parse_completion_request(json.dumps({"prompt": [1, 2, 3]}).encode(), MODELS)
    assert prompt_token_ids(request, tokenizer) == [1, 2, 3]
    request = parse_completion_request(json.dumps({"prompt": [1, len(tokenizer)]}).encode(), MODELS)
    with pytest.raises(APIError) as info:
        prompt_token_ids(request, tokenizer)
    assert (info.value.status, info.value.param) == (400, "prompt") and "prompt[1]" in info.value.message


def test_chat_prompt_uses_the_template(tokenizer):
    request = parse_chat_request(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode(), MODELS
    )
    assert tokenizer.decode(prompt_token_ids(request, tokenizer)).endswith("<|im_start|>assistant\n")
