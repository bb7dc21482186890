"""A /v1/responses body, read into the chat request the engine serves (gateway/openai/request.py): its input items,
instructions and a previous response's conversation become chat messages, its flat function tools and text.format
become chat's tools and response_format, so every check and limit of chat applies as it stands. What OpenAI's
Responses API offers beyond that (built-in tools, background runs, prompt templates, conversations) is refused by
name, never ignored.

Items are kept in one plain form, which a stored conversation holds too (gateway/response_store.py):
{"type": "message", "role", "content": text}, {"type": "function_call", "call_id", "name", "arguments"},
{"type": "function_call_output", "call_id", "output"}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from gateway.api_error import APIError, invalid_request
from gateway.openai.body import typed_field
from gateway.openai.request import OpenAIRequest, parse_chat_body
from gateway.openai.request_limits import RequestLimits

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
# OpenAI's bounds on metadata
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_IDENTIFIER_CHARS = 256  # user, safety_identifier, call ids: names, not text

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# parameters of OpenAI's that change what is served, and why they are not: refused whenever given a value
_REFUSED = {
    "conversation": "conversations are not served; continue one with previous_response_id",
    "prompt": "prompt templates are not served; send instructions and input",
    "top_logprobs": "top_logprobs is not served on /v1/responses",
    "max_tool_calls": "max_tool_calls is not served",
    "prompt_cache_key": "prompt_cache_key is not needed: requests are routed by their prompt's cached blocks",
    "prompt_cache_retention": "prompt_cache_retention is not served: cached blocks live while memory allows",
    "context_management": "context_management is not served",
}


@dataclass(slots=True)
class ResponsesRequest:
    chat: OpenAIRequest  # what the engine is asked, as a chat request
    items: list[dict]  # the conversation so far: the previous response's, then this request's input items
    echo: dict  # the request's fields that its Response object repeats
    store: bool


def previous_response_id(body: dict) -> str | None:
    """Read before the rest: the conversation it names is fetched from Redis first. A malformed id names no
    response, so it is answered as one that does not exist."""
    previous = typed_field(body, "previous_response_id", str, "a string")
    if previous is not None and not RESPONSE_ID.fullmatch(previous):
        raise response_not_found(previous, "previous_response_id")
    return previous


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    """One answer for absent, expired, deleted, not stored and another tenant's: none of them is this caller's."""
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    code = "previous_response_not_found" if param else "response_not_found"
    return APIError(404, f"Response with id {shown!r} not found.", "invalid_request_error", param, code)


def parse_responses_body(
    body: dict,
    history: list[dict],
    served_models: Collection[str],
    tool_call_parser: str | None,
    limits: RequestLimits,
) -> ResponsesRequest:
    """history: the items of the response previous_response_id names ([] without one)."""
    _refuse_unsupported(body)
    if "input" not in body:
        raise invalid_request("input is required", "input")
    items = [*history, *input_items(body["input"], limits)]
    instructions = typed_field(body, "instructions", str, "a string")
    metadata = _metadata(body)
    store = typed_field(body, "store", bool, "a boolean", True)
    for name in ("user", "safety_identifier"):
        value = typed_field(body, name, str, "a string")
        if value is not None and len(value) > MAX_IDENTIFIER_CHARS:
            raise invalid_request(f"{name} must be at most {MAX_IDENTIFIER_CHARS} characters", name)
    tools, chat_tools = _tools(body.get("tools"))
    chat = {
        "model": body.get("model"),
        "messages": chat_messages(instructions, items),
        "stream": body.get("stream"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "tools": chat_tools,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": _response_format(body),
        "user": body.get("user"),
    }
    try:
        parsed = parse_chat_body(
            {k: v for k, v in chat.items() if v is not None}, served_models, tool_call_parser, limits
        )
    except APIError as error:
        raise as_responses_error(error) from None
    if parsed.constraint_field is not None:  # the executor's errors about the grammar name it
        parsed.constraint_field = _renamed(parsed.constraint_field)
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,  # checked by chat's parser
        "previous_response_id": body.get("previous_response_id"),
        "temperature": parsed.sampling.temperature,
        "top_p": parsed.sampling.top_p,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
        "user": body.get("user"),
        "store": store,
    }
    return ResponsesRequest(parsed, items, echo, store)


def _refuse_unsupported(body: dict) -> None:
    for name, reason in _REFUSED.items():
        if body.get(name) is not None:
            raise invalid_request(f"{name}: {reason}", name)
    if typed_field(body, "background", bool, "a boolean", False):
        raise invalid_request(
            "background: background responses are not served; send stream or wait", "background"
        )
    include = typed_field(body, "include", list, "a list", [])
    if include:
        raise invalid_request(
            f"include: {include[0]!r} is not served (no built-in tools, reasoning or logprobs to include)",
            "include",
        )
    reasoning = typed_field(body, "reasoning", dict, "an object", {})
    if any(value is not None for value in reasoning.values()):
        raise invalid_request("reasoning: this model has no reasoning options to set", "reasoning")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise invalid_request(
            f"truncation: only 'disabled' is served (a conversation longer than the context is refused), got "
            f"{truncation!r}",
            "truncation",
        )
    service_tier = body.get("service_tier")
    if service_tier not in (None, "auto", "default"):
        raise invalid_request(
            f"service_tier: only 'auto' and 'default' are served, got {service_tier!r}", "service_tier"
        )
    options = typed_field(body, "stream_options", dict, "an object", {})
    obfuscation = options.get("include_obfuscation")
    if obfuscation is not None and not isinstance(obfuscation, bool):
        raise invalid_request(
            "stream_options.include_obfuscation must be a boolean", "stream_options.include_obfuscation"
        )


def input_items(raw: object, limits: RequestLimits) -> list[dict]:
    """input: a string (one user message) or a list of items, each read into the plain form."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid_request("input must be a string or a list of items", "input")
    if len(raw) > limits.max_messages:
        raise invalid_request(
            f"input: the number of items {len(raw)} exceeds this server's limit of {limits.max_messages} "
            "(--max-messages)",
            "input",
        )
    return [_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _item(item: object, where: str) -> dict:
    if not isinstance(item, dict):
        raise invalid_request(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise invalid_request(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
            )
        return {"type": "message", "role": role, "content": _text(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        call = {
            "type": "function_call",
            "call_id": _name(item, "call_id", where),
            "name": _name(item, "name", where),
        }
        arguments = item.get("arguments")
        try:
            valid = isinstance(arguments, str) and isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        if not valid:
            raise invalid_request(
                f"{where}.arguments must be the text of a JSON object", f"{where}.arguments"
            )
        return call | {"arguments": arguments}
    if kind == "function_call_output":
        output = _text(item.get("output"), f"{where}.output")
        return {"type": "function_call_output", "call_id": _name(item, "call_id", where), "output": output}
    raise invalid_request(
        f"{where}.type {kind!r} is not served: input items are messages, function_call and function_call_output",
        f"{where}.type",
    )


def _name(item: dict, field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_IDENTIFIER_CHARS:
        raise invalid_request(
            f"{where}.{field} must be a string of 1 to {MAX_IDENTIFIER_CHARS} characters", f"{where}.{field}"
        )
    return value


def _text(content: object, where: str) -> str:
    """A string, or a list of text parts (input_text, output_text) joined; images, files and audio are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where} must be a string or a list of input_text parts", where)
    texts = []
    for i, part in enumerate(content):
        param = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise invalid_request(
                f"{param}.type {kind!r} is not served: only text parts are (input_text)", f"{param}.type"
            )
        if not isinstance(part.get("text"), str):
            raise invalid_request(f"{param}.text must be a string", f"{param}.text")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The conversation as chat messages: an assistant's text and the calls that follow it are one message, as
    the model wrote them, so the template renders a stored turn as it was generated (its blocks then hash the same)."""
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    for item in items:
        if item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _tools(raw: object) -> tuple[list[dict], list[dict] | None]:
    """(the tools as the Response repeats them, as chat's tools): function tools only, flat as OpenAI's Responses
    API writes them ({type, name, description, parameters, strict})."""
    if raw is None:
        return [], None
    if not isinstance(raw, list):
        raise invalid_request("tools must be a list of {type: 'function', name, parameters} objects", "tools")
    tools, chat = [], []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind != "function":
            raise invalid_request(
                f"{where}.type {kind!r} is not served: kvserve serves function tools only", f"{where}.type"
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        chat.append({"type": "function", "function": function})
        tools.append({"type": "function", "description": None, "parameters": None, "strict": True} | function)
    return tools, chat


def _tool_choice(raw: object) -> object:
    """Chat's form of tool_choice: the strings are the same; a named function is nested there."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise invalid_request(
        f"tool_choice {kind!r} is not served: give 'none', 'auto', 'required' or {{type: 'function', name}}",
        "tool_choice",
    )


def _response_format(body: dict) -> dict | None:
    """text.format as chat's response_format: json_schema's fields are flat here, nested in json_schema there."""
    text = typed_field(body, "text", dict, "an object", {})
    if text.get("verbosity") is not None:
        raise invalid_request("text.verbosity is not served", "text.verbosity")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise invalid_request(f"text.format must be an object, got {form!r}", "text.format")
    if form.get("type") != "json_schema":
        return {"type": form.get("type")}
    return {"type": "json_schema", "json_schema": {k: form.get(k) for k in ("name", "schema", "strict")}}


def _metadata(body: dict) -> dict | None:
    metadata = typed_field(body, "metadata", dict, "an object of strings")
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid_request(
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid_request(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}", "metadata"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid_request(
                f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS} characters",
                "metadata",
            )
    return metadata


# chat's names for the fields a Responses request gave, in the order they are tried
_RENAMES = (
    (re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"response_format\.json_schema"), "text.format"),
    (re.compile(r"response_format"), "text.format"),
    (re.compile(r"messages(\[\d+\])?"), "input"),
)


def _renamed(text: str) -> str:
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


def as_responses_error(error: APIError) -> APIError:
    """An error of the chat path (its checks, the context length), naming the Responses request's fields."""
    param = _renamed(error.param) if error.param else error.param
    return APIError(error.status, _renamed(error.message), error.type, param, error.code, error.headers)
