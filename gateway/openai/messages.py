"""A chat request's `messages`, checked for shape and read into plain messages the chat template renders."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.api_error import invalid_request

ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str  # text parts already joined: templates expect a plain string
    # an assistant turn's calls, arguments read into objects (as transformers' templates expect them)
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = (
        None  # a tool result: the function that was called (found from tool_call_id if not sent)
    )


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
        chat = ChatMessage(role, _content(message.get("content"), where, role))
        if role == "assistant" and message.get("tool_calls") is not None:
            chat.tool_calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        for field in ("tool_call_id", "name"):
            value = message.get(field)
            if value is not None and not isinstance(value, str):
                raise invalid_request(f"{where}.{field} must be a string", f"{where}.{field}")
            setattr(chat, field, value)
        messages.append(chat)
    _name_tool_results(messages)
    return messages


def _tool_calls(raw: object, where: str) -> list[dict]:
    """OpenAI's [{id, type: "function", function: {name, arguments: JSON text}}], arguments read as JSON."""
    if not isinstance(raw, list):
        raise invalid_request(f"{where} must be a list of tool calls", where)
    calls = []
    for i, call in enumerate(raw):
        param = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise invalid_request(
                f"{param} must be {{type: 'function', function: {{name, arguments}}}}", param
            )
        if not isinstance(function.get("name"), str):
            raise invalid_request(f"{param}.function.name must be a string", f"{param}.function.name")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid_request(
                f"{param}.function.arguments must be the text of a JSON object", f"{param}.function.arguments"
            )
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise invalid_request(f"{param}.id must be a string", f"{param}.id")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        calls.append({"id": call["id"], **entry} if call.get("id") is not None else entry)
    return calls


def _name_tool_results(messages: list[ChatMessage]) -> None:
    """OpenAI's tool results name only their call's id; templates (vLLM's Hermes one) may want the function."""
    names = {}
    for message in messages:
        for call in message.tool_calls or ():
            if "id" in call:
                names[call["id"]] = call["function"]["name"]
        if message.role == "tool" and message.name is None and message.tool_call_id in names:
            message.name = names[message.tool_call_id]
