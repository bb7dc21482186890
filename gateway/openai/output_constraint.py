"""The constraint on a request's output, from whichever field asks for one: OpenAI's response_format, vLLM's
structured_outputs or its older guided_* fields, or a tool_choice that demands a call (gateway/openai/tools.py).
Errors name the field the request used, not the StructuredOutputsParams the executor is sent."""

from __future__ import annotations

import dataclasses

from gateway.api_error import invalid_request
from gateway.openai.body import typed_field
from gateway.openai.tools import ToolCalling
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams

# vLLM's older names for structured outputs, each one StructuredOutputsParams field
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(body: dict) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams fields; None for plain text."""
    response_format = typed_field(body, "response_format", dict, "an object", {"type": "text"})
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_request(
                "response_format.json_schema must be an object with name and schema",
                "response_format.json_schema",
            )
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(
                f"response_format.json_schema.name must be a non-empty string, got {name!r}",
                "response_format.json_schema.name",
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request(
                f"response_format.json_schema.strict must be a boolean, got {strict!r}",
                "response_format.json_schema.strict",
            )
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise invalid_request(
                f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}",
                "response_format.json_schema.schema",
            )
        return {"json": schema}
    raise invalid_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format.type",
    )


def _constraint(body: dict) -> tuple[str, dict] | None:
    """(the request's field, StructuredOutputsParams fields) from whichever of OpenAI's and vLLM's fields the
    request uses to constrain its output (one at most)."""
    given: dict[str, dict] = {}
    response_format = _response_format(body)
    if response_format is not None:
        given["response_format"] = response_format
    if body.get("structured_outputs") is not None:
        value = body["structured_outputs"]
        if not isinstance(value, dict):
            raise invalid_request(
                f"structured_outputs must be an object, got {value!r}", "structured_outputs"
            )
        given["structured_outputs"] = value
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            given[name] = {kind: body[name]}
    if len(given) > 1:
        names = ", ".join(given)
        raise invalid_request(f"give one way of constraining the output, got {names}", next(iter(given)))
    return next(iter(given.items()), None)


def _field_used(param: str, kind: str | None) -> str:
    """The field of the request that holds a constraint of this kind: what errors about it name."""
    if param == "structured_outputs":
        return f"structured_outputs.{kind}" if kind else param
    if (param, kind) == ("response_format", "json"):
        return "response_format.json_schema.schema"
    return param


def constraint_field(body: dict) -> str | None:
    """The field the request's constraint came from (checked already by structured_outputs_of), or None."""
    given = _constraint(body)
    return None if given is None else _field_used(given[0], next(iter(given[1]), None))


def structured_outputs_of(body: dict) -> StructuredOutputsParams | None:
    given = _constraint(body)
    if given is None:
        return None
    param, value = given
    try:
        return StructuredOutputsParams.from_wire(value)
    except ValueError as exc:
        message, kind = str(exc), next(iter(value), None)
        used = _field_used(param, kind)
        if param != "structured_outputs":  # name the field the request used
            message = message.replace(f"structured_outputs.{kind}", used, 1).replace(
                "structured_outputs", used, 1
            )
        raise invalid_request(message, used if message.startswith(used) else param) from exc


def constrain_to_call(sampling: SamplingParams, tools: ToolCalling | None) -> SamplingParams:
    """tool_choice "required" or a named function: the output is constrained to one call (gateway/openai/tools.py)."""
    constraint = tools.constraint() if tools is not None else None
    if constraint is None:
        return sampling
    if sampling.structured_outputs is not None:
        raise invalid_request(
            f"tool_choice {tools.function or tools.choice!r} constrains the output to a tool call; it cannot "
            "also follow response_format or structured_outputs",
            "tool_choice",
        )
    return dataclasses.replace(sampling, structured_outputs=constraint)
