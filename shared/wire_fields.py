"""Reading a decoded msgpack map's fields with a clear error for each that is missing, of the wrong type or out of
its range: the checks shared.protocol's readers make of every message, the error each side answers or logs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ProtocolError(ValueError):
    """A message this side cannot accept; request_id is set when the message named one, so it can be answered."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class Fields:
    """One map of a message (kind names it in errors: "step message outputs[2]")."""

    def __init__(self, body: dict, kind: str, request_id: str | None) -> None:
        self.body, self.kind, self.request_id = body, kind, request_id

    def get(self, name: str, check: Callable[[object], bool], expected: str, default: object = ...) -> Any:
        if name not in self.body:
            if default is ...:
                raise ProtocolError(f"{self.kind} message: missing field {name!r}", self.request_id)
            return default
        value = self.body[name]
        if not check(value):
            raise ProtocolError(
                f"{self.kind} message: field {name!r} must be {expected}, got {value!r:.80}", self.request_id
            )
        return value

    def text(self, name: str) -> str:
        return self.get(name, lambda v: isinstance(v, str), "a string")

    def optional_text(self, name: str) -> str | None:
        return self.get(name, lambda v: v is None or isinstance(v, str), "a string or nil", None)
