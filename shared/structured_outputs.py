"""What a request's output must match, vLLM's StructuredOutputsParams: one of a JSON schema, any JSON object, a
regex, a choice of strings or an EBNF grammar. Checked for shape here (both sides), and a schema for keywords the
grammar library would not enforce (shared/json_schema_support.py); whether a schema, regex or grammar compiles is
the executor's grammar library's to say."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.json_schema_support import unenforced_keyword

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema, as an object or its text; normalised to the text
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) if given else 'none'}"
            )
        if isinstance(self.json, dict):
            self.json = _schema_text(self.json)
        elif self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        if self.json is not None:
            check_enforceable(json.loads(self.json), "structured_outputs.json")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
                )
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def to_wire(self) -> dict:
        """The one field set, as msgpack carries it."""
        return {self.kind: getattr(self, self.kind)}

    @classmethod
    def from_wire(cls, value: object) -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {value!r}")
        unknown = set(value) - set(KINDS)
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field {sorted(unknown)[0]!r} (expected {', '.join(KINDS)})"
            )
        return cls(**value)


def check_enforceable(schema: object, field: str) -> None:
    """ValueError naming `field` when the schema asks what the grammar library would not hold."""
    if (unenforced := unenforced_keyword(schema)) is not None:
        raise ValueError(f"{field} uses {unenforced}, which this server cannot enforce")


def _schema_text(schema: dict) -> str:
    """Keys keep their order: a grammar emits an object's properties in the order its schema lists them."""
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json cannot be serialised: {error}") from None
