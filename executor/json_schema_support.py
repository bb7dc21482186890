"""JSON Schema keywords the grammar library (xgrammar 0.2.9) accepts but compiles to nothing: a schema using one
is refused naming it, never served as if it held. tests/executor/test_json_schema_support.py checks each still
compiles to the grammar of the same schema without it, so a library that learns one shows up there."""

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
# where a schema holds subschemas: by name, in a list, or as the value itself
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
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
    """The first keyword of UNENFORCED the schema uses, as 'KEYWORD at /json/pointer (what it asks)', or None;
    `uniqueItems: false` asks nothing and passes."""
    if not isinstance(schema, dict):
        return None
    for keyword, meaning in UNENFORCED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return f"{keyword} at {path or '/'} ({meaning})"
    children: list[tuple[str, object]] = []
    for key in _SCHEMA_MAPS:
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
