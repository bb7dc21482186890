"""The schema keywords refused as unenforced are exactly ones the grammar library compiles to nothing."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from executor.json_schema_support import UNENFORCED, unenforced_keyword  # noqa: E402

ITEMS = {"type": "array", "items": {"type": "integer"}}
OBJECT = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
# each keyword on a schema that is otherwise the base
WITH_KEYWORD = {
    "if": (OBJECT, {"if": {"required": ["a"]}}),
    "then": (OBJECT, {"then": {"required": ["a"]}}),
    "else": (OBJECT, {"else": {"required": ["b"]}}),
    "dependentRequired": (OBJECT, {"dependentRequired": {"a": ["b"]}}),
    "dependentSchemas": (OBJECT, {"dependentSchemas": {"a": {"required": ["b"]}}}),
    "uniqueItems": (ITEMS, {"uniqueItems": True}),
    "contains": (ITEMS, {"contains": {"const": 1}}),
    "unevaluatedProperties": (OBJECT, {"unevaluatedProperties": False}),
    "unevaluatedItems": (ITEMS, {"unevaluatedItems": False}),
}


def grammar(schema: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_each_refused_keyword_compiles_to_the_grammar_without_it(keyword):
    base, extra = WITH_KEYWORD[keyword]
    assert grammar({**base, **extra}) == grammar(base)


def test_a_keyword_the_library_enforces_changes_the_grammar():  # the check above can tell
    assert grammar({**ITEMS, "minItems": 2}) != grammar(ITEMS)


def test_keywords_are_found_wherever_a_subschema_sits():
    deep = {
        "type": "object",
        "$defs": {"Tag": {"type": "array", "uniqueItems": True}},
        "properties": {"if": {"type": "string"}, "tags": {"$ref": "#/$defs/Tag"}},
    }
    assert unenforced_keyword(deep) == "uniqueItems at /$defs/Tag (distinct array items)"
    nested = {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"if": {}}}}]}
    assert unenforced_keyword(nested) == "if at /anyOf/1/properties/x (conditional subschemas (if/then/else))"
    assert unenforced_keyword({"type": "array", "items": [{"contains": {}}]}).startswith(
        "contains at /items/0"
    )


def test_schemas_without_them_pass():
    pydantic_like = {
        "$defs": {"Pet": {"properties": {"name": {"title": "Name", "type": "string"}}, "type": "object"}},
        "properties": {
            "pets": {"items": {"$ref": "#/$defs/Pet"}, "type": "array", "uniqueItems": False},
            "if": {"type": "string", "enum": ["if", "then"], "default": "if"},  # names and data, not keywords
        },
        "required": ["pets"],
        "title": "Owner",
        "type": "object",
    }
    assert unenforced_keyword(pydantic_like) is None
    assert unenforced_keyword(True) is None
