"""The schema keywords refused as unenforced are ones the grammar library does not hold: compiled to nothing, or,
for those it holds in some uses only, letting through a value the schema forbids. Also the string rule
executor/structured/grammar_compile.py rewrites."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

import jsonschema  # noqa: E402

from executor.structured.grammar_compile import json_grammar  # noqa: E402
from shared.json_schema_support import UNENFORCED, unenforced_keyword  # noqa: E402

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


def prop(schema: dict) -> dict:
    return {"type": "object", "properties": {"a": schema}, "required": ["a"]}


# a schema using a keyword the library holds only in some uses, a value it forbids, and what names it
PARTLY = [
    (prop({"type": "number", "multipleOf": 0.5}), 1.3, "multipleOf at /properties/a"),
    (prop({"not": {"type": "integer"}}), 1, "not at /properties/a"),
    (prop({"type": "string", "pattern": "^a+$", "maxLength": 3}), "aaaa", "maxLength at /properties/a"),
    (prop({"type": "string", "pattern": "^a+$", "minLength": 3}), "a", "minLength at /properties/a"),
]


@pytest.fixture(scope="module")
def compiler(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return xgr.GrammarCompiler(info), tokenizer.eos_token_id


def accepts(compiler, grammar_text: str, text: str) -> bool:
    compiled_with, eos = compiler
    matcher = xgr.GrammarMatcher(compiled_with.compile_grammar(grammar_text))
    return matcher.accept_string(text) and matcher.accept_token(eos)


@pytest.mark.parametrize(("schema", "value", "named"), PARTLY, ids=[named for *_, named in PARTLY])
def test_each_partly_held_keyword_lets_a_forbidden_value_through(compiler, schema, value, named):
    assert not jsonschema.Draft202012Validator(schema).is_valid({"a": value})
    assert accepts(compiler, grammar(schema), '{"a": ' + json.dumps(value) + "}")  # refusing it is right
    assert unenforced_keyword(schema).startswith(named)


def test_the_uses_the_library_holds_pass(compiler):
    held = [
        (prop({"type": "integer", "multipleOf": 3}), 10),
        (prop({"type": "string", "pattern": "^a+$"}), "b"),
        (prop({"type": "string", "maxLength": 3}), "aaaa"),
        (prop({"type": "string", "format": "email"}), "not-an-email"),
    ]
    for schema, value in held:
        assert unenforced_keyword(schema) is None, schema
        assert not accepts(compiler, json_grammar(json.dumps(schema)), '{"a": ' + json.dumps(value) + "}")


def test_strings_with_a_length_are_held_to_json_string_rules(compiler):
    schema = json.dumps(prop({"type": "string", "maxLength": 3}))
    raw = '{"a": "x\ty"}'  # a raw tab: not JSON
    assert accepts(compiler, grammar(json.loads(schema)), raw)  # the library's own rule lets it through
    assert not accepts(compiler, json_grammar(schema), raw)
    for value in ["x\ty", 'a"b', "\u00e9ab", "\n", "abc"]:  # escapes count as one character
        assert accepts(compiler, json_grammar(schema), json.dumps({"a": value})), value
        assert accepts(compiler, json_grammar(schema), json.dumps({"a": value}, ensure_ascii=False)), value
    assert not accepts(compiler, json_grammar(schema), json.dumps({"a": "abcd"}))
    assert not accepts(compiler, json_grammar(schema), json.dumps({"a": 'a"bc'}))
