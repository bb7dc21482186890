"""JSON Schema keywords the executor's grammar library (xgrammar 0.2.9) accepts but does not enforce: a schema
using one is refused naming it and where it sits, never served as if it held. Here in shared/ so the gateway
refuses it at the door, naming the request's own field (response_format, a tool's parameters), and the offline
API at SamplingParams.

Two kinds: keywords compiled to nothing (UNENFORCED), and keywords enforced only in some uses (`_partly`):
`multipleOf` holds on integers but not on numbers, `not` is dropped, and `pattern` wins over
`minLength`/`maxLength`. tests/executor/test_json_schema_support.py checks each against the library, so one it
learns shows up there."""

from __future__ import annotations

# keyword -> why the output would not honour it
UNENFORCED = {
    "if": "conditional subschemas (if/then/else)",
    "then": "conditional subschemas (if/then/else)",
    "else": "conditional subschemas (if/then/else)",
    "dependentRequired": "properties required by others",
    "dependentSchemas": "subschemas applied by others' presence",
    "uniqueItems": "distinct array items",
    "contains": "an item every array must contain",  # and so minContains / maxContains, which need it
    "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items",
}


def _partly(schema: dict) -> tuple[str, str] | None:
    """A keyword the library enforces in some uses only, when this schema uses it in another."""
    if "not" in schema:
        return "not", "a subschema the value must not match"
    multiple = schema.get("multipleOf")
    if multiple is not None and not (schema.get("type") == "integer" and _is_integer(multiple)):
        return "multipleOf", "a multiple of a step, held only for integer types with an integer step"
    if "pattern" in schema:
        for keyword in ("minLength", "maxLength"):
            if keyword in schema:
                return keyword, "a string length beside a pattern, which the pattern overrides"
    return None


def _is_integer(value: object) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


# where a schema holds subschemas: by name, in a list, or as the value itself
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "additionalItems",
    "not",
    "propertyNames",
    "contains",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def unenforced_keyword(schema: object, path: str = "") -> str | None:
    """The first keyword the schema uses that would not hold, as 'KEYWORD at /json/pointer (what it asks)', or
    None; `uniqueItems: false` asks nothing and passes."""
    if not isinstance(schema, dict):
        return None
    for keyword, meaning in UNENFORCED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return f"{keyword} at {path or '/'} ({meaning})"
    if (partly := _partly(schema)) is not None:
        keyword, meaning = partly
        return f"{keyword} at {path or '/'} ({meaning})"
    children: list[tuple[str, object]] = []
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{path}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    for key in _SCHEMA_VALUES:
        if key in schema:
            value = schema[key]
            subs = enumerate(value) if isinstance(value, list) else [(None, value)]
            children += [(f"{path}/{key}" + ("" if i is None else f"/{i}"), sub) for i, sub in subs]
    for child_path, sub in children:
        if (found := unenforced_keyword(sub, child_path)) is not None:
            return found
    return None
