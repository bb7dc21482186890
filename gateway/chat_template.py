"""Chat messages become prompt token ids through the model's own chat template, after checking their shape."""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from gateway.api_error import APIError, invalid_request

ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str  # text parts already joined: templates expect a plain string


def _content(raw: object, where: str, role: str) -> str:
    """A string, or OpenAI's list of {"type": "text", "text": ...} parts; images and audio are refused."""
    if isinstance(raw, str):
        return raw
    if raw is None and role == "assistant":  # an assistant turn that only called tools has no text
        return ""
    if not isinstance(raw, list):
        raise invalid_request(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    texts = []
    for i, part in enumerate(raw):
        param = f"{where}.content[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid_request(
                f"{param} must be an object with type 'text' (only text is supported)", param
            )
        if not isinstance(part.get("text"), str):
            raise invalid_request(f"{param}.text must be a string", f"{param}.text")
        texts.append(part["text"])
    return "".join(texts)


def parse_messages(raw: object) -> list[ChatMessage]:
    """Checked at the door so a bad role or content is a 400 naming it, not a template crash."""
    if not isinstance(raw, list):
        raise invalid_request("messages must be a list of message objects", "messages")
    if not raw:
        raise invalid_request("messages must not be empty", "messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_request(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid_request(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
            )
        if "content" not in message and role != "assistant":
            raise invalid_request(f"{where}.content is required", f"{where}.content")
        messages.append(ChatMessage(role, _content(message.get("content"), where, role)))
    return messages


def chat_prompt_token_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Render then encode without special tokens: the template already wrote them, a second BOS would differ."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # the template's own raise_exception(), e.g. a role-alternation rule
        raise invalid_request(f"messages rejected by the chat template: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)
