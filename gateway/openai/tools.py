"""`tools` and `tool_choice` on /v1/chat/completions: their shapes checked once, and the JSON schema that makes
tool_choice "required" or a named function always produce a valid call.

How a call is made, by tool_choice:
- "none": the tools are left out of the prompt and the output is text.
- "auto": the model decides; its Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` output is parsed
  (gateway/openai/tool_parser.py) by the parser the gateway chose at start (vLLM's `--tool-call-parser`; by
  default the one the chat template implies: gateway/prompt/chat_template.py, choose_tool_call_parser).
- "required" and a named function: the output is constrained (structured_outputs, json) to the JSON object a
  Hermes call carries, `{"name": <one of the tools>, "arguments": <its parameters>}`, so it always is one valid
  call. vLLM constrains a named function to its parameters alone and "required" to an array of calls; one
  object for both keeps one parser for every mode, and its closing brace ends the output, where an array lets
  a small model go on adding calls until max_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gateway.api_error import invalid_request
from shared.json_schema_support import SCHEMA_MAPS
from shared.structured_outputs import StructuredOutputsParams, check_enforceable

TOOL_CALL_PARSERS = ("hermes",)  # the parsers kvserve has, by vLLM's names for them
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none


@dataclass(slots=True)
class ToolCalling:
    """The tools a request's model may call, and how."""

    tools: list[dict]  # as the chat template receives them: {"type": "function", "function": {name, ...}}
    choice: str  # "auto", "required" or "function" (the one named in `function`)
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call of an "auto" output

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    @property
    def constrained(self) -> bool:
        """The output is the call's JSON itself, with no <tool_call> tags around it."""
        return self.choice != "auto"

    def constraint(self) -> StructuredOutputsParams | None:
        """What required and named choices hand the executor; the schema's text keeps "name" before
        "arguments", so the model writes (or is given) the name first, as Hermes does."""
        if not self.constrained:
            return None
        functions = [
            tool["function"]
            for tool in self.tools
            if self.choice == "required" or tool["function"]["name"] == self.function
        ]
        if len(functions) == 1:
            schema = call_schema(functions[0])
        else:
            schema = {"anyOf": [call_schema(f, at=f"/anyOf/{i}") for i, f in enumerate(functions)]}
        return StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False))


def call_schema(function: dict, at: str = "") -> dict:
    """One call of `function`, as the JSON object inside a Hermes <tool_call>, placed at JSON pointer `at` of
    the schema it goes into: the parameters' own references ($defs of a Pydantic model) point where they land."""
    parameters = function.get("parameters", _NO_PARAMETERS)
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": _moved(parameters, f"{at}/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: a "$ref" there is data


def _moved(schema: object, to: str) -> object:
    """`schema` with each local $ref ("#", "#/...") pointing into where it now sits, at JSON pointer `to`."""
    if isinstance(schema, list):
        return [_moved(item, to) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = "#" + to + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):  # names there are the client's, not keywords
            moved[key] = {name: _moved(sub, to) for name, sub in value.items()}
        else:
            moved[key] = _moved(value, to)
    return moved


def parse_tool_calling(body: dict, tool_call_parser: str | None) -> ToolCalling | None:
    """None when the model may call nothing: no tools, or tool_choice "none" (the prompt then leaves them
    out). OpenAI's default is "auto" when tools are given."""
    tools = _tools(body.get("tools"))
    choice, function_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid_request(
            f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls"
        )
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):  # the schemas a required or named call is held to
        function = tool["function"]
        if choice == "required" or (choice == "function" and function["name"] == function_name):
            where = f"tools[{i}].function.parameters"
            try:
                check_enforceable(function.get("parameters", _NO_PARAMETERS), where)
            except ValueError as exc:
                raise invalid_request(str(exc), where) from None
    if choice == "auto" and tool_call_parser is None:
        raise invalid_request(
            'tool_choice "auto" (the default when tools are given) needs a tool-call parser, and this gateway '
            "has none (--tool-call-parser none, or a chat template whose calls it cannot tell: its start-up log "
            "says which); start it with --tool-call-parser hermes for a model that writes <tool_call> tags, or "
            'send tool_choice "required", a named function or "none"',
            "tool_choice",
        )
    return ToolCalling(tools, choice, function_name, parallel)


def _tools(raw: object) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_request("tools must be a list of {type: 'function', function: {...}} objects", "tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise invalid_request(
                f"{where}.type must be 'function' (the only kind of tool served), got {tool.get('type')!r}",
                f"{where}.type",
            )
        function = _function(tool.get("function"), f"{where}.function")
        if function["name"] in names:
            raise invalid_request(
                f"{where}.function.name {function['name']!r} is given twice", f"{where}.function.name"
            )
        names.add(function["name"])
        tools.append({"type": "function", "function": function})
    return tools


def _function(raw: object, where: str) -> dict:
    """name, description and parameters, checked; what else the client sent (strict) goes to the template."""
    if not isinstance(raw, dict):
        raise invalid_request(f"{where} must be an object with a name", where)
    name = raw.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise invalid_request(
            f"{where}.name must be 1-64 letters, digits, underscores or dashes, got {name!r}", f"{where}.name"
        )
    if raw.get("description") is not None and not isinstance(raw["description"], str):
        raise invalid_request(f"{where}.description must be a string", f"{where}.description")
    if raw.get("strict") is not None and not isinstance(raw["strict"], bool):
        raise invalid_request(f"{where}.strict must be a boolean", f"{where}.strict")
    parameters = raw.get("parameters")
    # arguments are a JSON object in OpenAI's API, so the schema must describe one
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise invalid_request(
            f"{where}.parameters must be a JSON schema of an object (type 'object')", f"{where}.parameters"
        )
    return {key: value for key, value in raw.items() if value is not None}


def _tool_choice(raw: object, tools: list[dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the named function)."""
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("none", "auto"):
        return raw, None
    if raw == "required":
        if not tools:
            raise invalid_request('tool_choice "required" needs tools to choose from', "tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_request(
                "tool_choice.function.name must be a string naming one of the tools",
                "tool_choice.function.name",
            )
        if name not in [tool["function"]["name"] for tool in tools]:
            given = ", ".join(tool["function"]["name"] for tool in tools) or "none"
            raise invalid_request(
                f"tool_choice names the function {name!r}, which is not in tools (given: {given})",
                "tool_choice.function.name",
            )
        return "function", name
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {raw!r}",
        "tool_choice",
    )
