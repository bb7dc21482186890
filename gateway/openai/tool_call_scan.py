"""One tool call's JSON text read as it grows, each character once: `{"name": ..., "arguments": {...}}`, keys in
any order. Nested values are only delimited here; json.loads checks the whole object once it closes."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass


class CallText:
    """One call's text as it grows: appended in amortised constant time, read back by position."""

    def __init__(self) -> None:
        self._buffer = io.StringIO()
        self.length = 0

    def append(self, text: str) -> None:
        self._buffer.seek(self.length)
        self._buffer.write(text)
        self.length += len(text)

    def truncate(self, length: int) -> None:
        self._buffer.truncate(length)
        self.length = length

    def slice(self, start: int, end: int) -> str:
        self._buffer.seek(start)
        return self._buffer.read(end - start)

    def value(self) -> str:
        return self._buffer.getvalue()


_SPACE = " \t\r\n"


@dataclass(slots=True)
class CallScan:
    """How far a call's JSON text has got, and what it says so far; the fields past `end` are its place in the
    text, so that reading on from there, or from a copy of it, costs only the characters read."""

    state: str = "partial"  # "partial", "complete" (the object closed at `end`) or "invalid"
    name: str | None = None  # the last "name" whose string is complete
    arguments_start: int | None = None  # where the (last) arguments object's text starts
    arguments_end: int | None = None  # one past its closing brace, once it has one
    end: int | None = None
    # what it expects next: "object", "key" (or "}" while first), "key_text", "colon", "value", "string",
    # "nested", "bare" (a number or literal), "after_value"
    expect: str = "object"
    position: int = 0  # of the next character to read
    first: bool = True  # no key yet
    key: str | None = None  # of the value being read
    start: int = 0  # of the string or value being read
    escaped: bool = False  # the last character was a backslash inside a string
    depth: int = 0  # of brackets, in a nested value
    in_string: bool = False  # inside a string, in a nested value

    def read(self, text: CallText, end: int) -> None:
        """Read on to text position end (once it is complete or invalid, there is nothing more to read)."""
        if self.state != "partial" or end <= self.position:
            return
        for c in text.slice(self.position, end):
            if self.state != "partial":
                return
            self._read_char(c, text)
            self.position += 1

    def _read_char(self, c: str, text: CallText) -> None:
        expect = self.expect
        if expect in ("key_text", "string"):
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self._string_read(text)
        elif expect == "nested":
            self._read_nested(c, text)
        elif expect == "bare":
            if not (c.isalnum() or c in "+-."):
                self._value_read(self.position, text)
                self._read_char(c, text)  # the character after the value
        elif c in _SPACE:
            pass
        elif expect == "object":
            if c != "{":
                return self._invalid()
            self.expect = "key"
        elif expect == "key":
            if c == "}" and self.first:
                self._close(text)
            elif c == '"':
                self.expect, self.start = "key_text", self.position
            else:
                self._invalid()
        elif expect == "colon":
            if c != ":":
                return self._invalid()
            self.expect = "value"
        elif expect == "value":
            self._value_starts(c)
        elif c == "}":  # after_value
            self._close(text)
        elif c == ",":
            self.expect, self.first = "key", False
        else:
            self._invalid()

    def _invalid(self) -> None:
        self.state = "invalid"

    def _string_read(self, text: CallText) -> None:
        if self.expect == "string":
            return self._value_read(self.position + 1, text)
        self.key = _string(text.slice(self.start, self.position + 1))
        if self.key is None:
            return self._invalid()
        self.expect = "colon"

    def _value_starts(self, c: str) -> None:
        if c == '"':
            expect = "string"
        elif c in "{[":
            expect, self.depth, self.in_string = "nested", 1, False
        elif c.isalnum() or c in "+-.":
            expect = "bare"
        else:
            return self._invalid()
        if (self.key == "name" and c != '"') or (self.key == "arguments" and c != "{"):
            return self._invalid()
        if self.key == "arguments":
            self.arguments_start, self.arguments_end = self.position, None
        self.expect, self.start = expect, self.position

    def _read_nested(self, c: str, text: CallText) -> None:
        if self.escaped:
            self.escaped = False
        elif self.in_string:
            if c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._value_read(self.position + 1, text)

    def _value_read(self, end: int, text: CallText) -> None:
        if self.key == "arguments":
            self.arguments_end = end
        if self.key == "name":
            self.name = _string(text.slice(self.start, end))
            if self.name is None:
                return self._invalid()
        self.expect = "after_value"

    def _close(self, text: CallText) -> None:
        try:
            json.loads(text.slice(0, self.position + 1))
        except ValueError:
            return self._invalid()
        self.state, self.end = "complete", self.position + 1


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # a bad escape
        return None
