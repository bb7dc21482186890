"""A request's prompt as token ids: chat through the template, text through the tokenizer, ids checked."""

from __future__ import annotations

from gateway.api_error import invalid_request
from gateway.openai.request import OpenAIRequest
from gateway.prompt.chat_template import chat_prompt_token_ids


def prompt_token_ids(request: OpenAIRequest, tokenizer) -> list[int]:
    """Text is encoded as the offline API encodes it, so both give the same greedy output."""
    if request.messages is not None:
        tools = request.tools.tools if request.tools is not None else None
        return chat_prompt_token_ids(tokenizer, request.messages, tools)
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    vocab_size = len(tokenizer)
    for i, token_id in enumerate(request.prompt or ()):
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"prompt[{i}] = {token_id} is not a token id (vocabulary size {vocab_size})", "prompt"
            )
    return list(request.prompt or ())
