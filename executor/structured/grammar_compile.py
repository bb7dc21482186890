"""What a structured-outputs spec compiles to: the grammar library's calls and the fixes its output needs. It runs in
the compile worker's process (executor/structured/grammar_worker.py), so it holds nothing but the compiler it is
given."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from shared.structured_outputs import StructuredOutputsParams

# xgrammar's errors start with "[time] /project/cpp/file.cc:line: "; the client needs what follows
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _library_message(error: Exception) -> str:
    return _LOCATION.sub("", str(error).strip()).strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF rule matching exactly one of the strings (JSON escapes are EBNF's string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes a string with minLength/maxLength as a run of [^"\\\r\n]: raw tabs and other control
# characters, which JSON forbids inside strings, pass, and escapes do not. Each such character is made the one
# plain strings use, or one escape (a JSON escape is one character of the string's length).
_LOOSE_STRING_CHARACTER = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_STRING_CHARACTER = r' ::= (([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'


def json_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, as the library writes it, with its strings held to JSON's rules. No free
    whitespace: a small model given the choice can fill max_tokens with newlines."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return _LOOSE_STRING_CHARACTER.sub(lambda rule: rule.group(1) + _STRING_CHARACTER, ebnf)


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """The spec's grammar for the compiler's tokenizer; a ValueError naming structured_outputs.<kind> and the
    library's message when it does not compile."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            return compiler.compile_grammar(json_grammar(spec.json or '{"type": "object"}'))
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choice))
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"structured_outputs.{kind}: {_library_message(error)}") from None
