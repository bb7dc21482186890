"""The Hermes tool-call parser (`--tool-call-parser hermes`): a model's output text becomes content and OpenAI
tool calls, as it streams.

A call is `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (tool_choice "auto"), or, when the output
was constrained to a call (tool_choice "required" or a named function), the JSON object alone. The same parser
serves streamed and whole responses, so both say the same: whole ones are the sum of the streamed deltas.

Rules, in the order they decide:
- Text that may still become the start of a `<tool_call>` tag is held back, so the tags never reach `content`;
  whitespace next to a call is dropped (only text around calls is content).
- A call starts to stream (id, type and name in its first delta) once its JSON is well-formed so far, its name
  is complete and names one of the request's tools, and its arguments object has begun (or the object closed
  without one: no arguments); its arguments then stream as the model writes them.
- A block that ends (its closing tag, or the output's end) before that happened is not a call: its raw text,
  tags included, is content, as is the whole output of a constrained request the model did not complete.
- A call whose name has streamed stays a call: cut short (max_tokens), its arguments are what was written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON object's text, exactly as the model wrote it (what the stream sent)

    def message_entry(self) -> dict:
        """OpenAI's message.tool_calls[i]."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """One call's part of a streamed chunk: its id, type and name the first time, then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def chunk_entry(self) -> dict:
        """OpenAI's delta.tool_calls[i]."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class _Scan:
    """How far a call's JSON text has got: `{"name": ..., "arguments": {...}}`, keys in any order."""

    state: str  # "partial", "complete" (the object closed at `end`) or "invalid"
    name: str | None = None  # once its string is complete
    arguments_start: int | None = None  # where the arguments object's text starts
    arguments_end: int | None = None  # one past its closing brace, once it has one
    end: int | None = None


def scan_call(text: str, resume: dict[int, tuple[int, int, bool]] | None = None) -> _Scan:
    """Reads as much of one call's JSON as there is; nested values are only delimited here, json.loads checks
    the whole object once it closes. resume: where unfinished objects were left, so a text that grows token by
    token is not read from its start each time (the same dict for each longer text of one call)."""
    scan = _Scan("partial")
    i = _skip_space(text, 0)
    if i == len(text):
        return scan
    if text[i] != "{":
        return _Scan("invalid")
    i, first = i + 1, True
    while True:
        i = _skip_space(text, i)
        if i == len(text):
            return scan
        if text[i] == "}" and first:
            break
        if text[i] != '"':
            return _Scan("invalid")
        key_end = _value_end(text, i)
        if key_end is None:
            return scan
        key = _string(text[i:key_end])
        if key is None:
            return _Scan("invalid")
        i = _skip_space(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            return _Scan("invalid")
        i = _skip_space(text, i + 1)
        if i == len(text):
            return scan
        value_end = _value_end(text, i, resume)
        if value_end == -1 or (key == "name" and text[i] != '"') or (key == "arguments" and text[i] != "{"):
            return _Scan("invalid")
        if key == "arguments":
            scan.arguments_start, scan.arguments_end = i, value_end
        if value_end is None:
            return scan
        if key == "name":
            scan.name = _string(text[i:value_end])
            if scan.name is None:
                return _Scan("invalid")
        i = _skip_space(text, value_end)
        if i == len(text):
            return scan
        if text[i] == "}":
            break
        if text[i] != ",":
            return _Scan("invalid")
        i, first = i + 1, False
    try:
        json.loads(text[: i + 1])
    except ValueError:
        return _Scan("invalid")
    scan.state, scan.end = "complete", i + 1
    return scan


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # a bad escape
        return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int, resume: dict[int, tuple[int, int, bool]] | None = None) -> int | None:
    """One past the JSON value starting at i; None if the text ends first, -1 if it cannot be one."""
    opening = text[i]
    if opening == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if opening in "{[":
        j, depth, in_string = resume.get(i, (i, 0, False)) if resume is not None else (i, 0, False)
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        if resume is not None:
            resume[i] = (j, depth, in_string)
        return None
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] in "+-."):
        j += 1
    if j == i:
        return -1
    return None if j == len(text) else j


@dataclass(slots=True)
class _OpenCall:
    """The call being read: its text so far, and what of it has streamed."""

    space_before: str = ""  # whitespace held before its tag: content again if it turns out not to be a call
    text: str = ""
    index: int | None = None  # set once it is a call (its name streamed)
    sent_arguments: int = 0  # characters of its arguments streamed
    resume: dict = field(default_factory=dict)  # scan_call's place in its unfinished objects


@dataclass
class ToolCallParser:
    """Feed it the output's text as it is released; it answers with the content and the tool-call deltas that
    text completes. `names`: the functions the request offered; `constrained`: the output is one call's JSON
    with no tags; `max_calls`: parallel_tool_calls false allows one, and drops what follows it."""

    names: list[str]
    constrained: bool = False
    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # released so far
    _pending: str = ""  # text not yet classified
    _space: str = ""  # whitespace held back: content only if more content follows (or no call came)
    _after_call: bool = False  # whitespace right after a call is not content
    _open: _OpenCall | None = None
    _plain: bool = False  # a constrained output that is not a call: the rest is content as it comes
    _done: bool = False  # max_calls reached, or a constrained call closed: the rest is dropped

    def __post_init__(self) -> None:
        if self.constrained:
            self._open = _OpenCall()

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content released, tool-call deltas) for this piece of the output; finished: it is the last."""
        self._pending += text
        content, deltas = "", []
        while not self._done:
            if self._plain:
                content += self._content(self._pending)
                self._pending = ""
                break
            if self._open is None:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if finished else _partial_tag(self._pending, TOOL_CALL_START)
                    content += self._content(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content += self._content(self._pending[:start])
                self._open = _OpenCall(space_before=self._space)  # whitespace before a call is not content
                self._space = ""
                self._pending = self._pending[start + len(TOOL_CALL_START) :]
                continue
            call = self._open
            end = -1 if self.constrained else self._pending.find(TOOL_CALL_END)
            call.text = self._pending if end < 0 else self._pending[:end]
            scan = scan_call(call.text, call.resume)
            deltas += self._stream(call, scan)
            # untagged, a prefix that is not JSON can never become a call; tagged, it may be the closing tag
            closed = end >= 0 or finished or (self.constrained and scan.state != "partial")
            if not closed:
                break
            self._pending = "" if end < 0 else self._pending[end + len(TOOL_CALL_END) :]
            content += self._close(call, scan, end >= 0, deltas)
        if finished and not self.calls:
            content += self._space  # a text answer keeps its trailing whitespace
            self.content += self._space
        if finished:
            self._space = ""
        return content, _merged(deltas)

    def _content(self, text: str) -> str:
        """Text outside calls, less the whitespace that only separates it from calls."""
        held = self._space + text
        if self._after_call:
            held = held.lstrip()
        released = held.rstrip()
        self._space = held[len(released) :]
        if released:
            self._after_call = False
        self.content += released
        return released

    def _stream(self, call: _OpenCall, scan: _Scan) -> list[ToolCallDelta]:
        deltas = []
        if call.index is None:
            started = scan.arguments_start is not None or scan.state == "complete"
            if scan.state == "invalid" or scan.name not in self.names or not started:
                return deltas
            call.index = len(self.calls)
            self.calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], scan.name, ""))
            deltas.append(ToolCallDelta(call.index, "", self.calls[-1].id, scan.name))
        if scan.state != "invalid" and scan.arguments_start is not None:
            written = call.text[scan.arguments_start : scan.arguments_end]
            if len(written) > call.sent_arguments:
                deltas.append(ToolCallDelta(call.index, written[call.sent_arguments :]))
                self.calls[call.index].arguments += written[call.sent_arguments :]
                call.sent_arguments = len(written)
        return deltas

    def _close(self, call: _OpenCall, scan: _Scan, tagged: bool, deltas: list[ToolCallDelta]) -> str:
        """A block has ended: a call is finished; anything else is content after all, tags and all."""
        self._open = None
        if call.index is None:
            if self.constrained:
                self._plain = True
                return self._content(call.text)
            self._space = call.space_before
            return self._content(TOOL_CALL_START + call.text + (TOOL_CALL_END if tagged else ""))
        if not self.calls[call.index].arguments:  # {"name": "f"}: a call without arguments
            deltas.append(ToolCallDelta(call.index, "{}"))
            self.calls[call.index].arguments = "{}"
        self._after_call = True
        self._done = self.constrained or (self.max_calls is not None and len(self.calls) >= self.max_calls)
        return ""


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of text that is the start of tag (it may yet become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One entry per call in a chunk: a call's name and first arguments ride together."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index:
            merged[-1].arguments += delta.arguments
        else:
            merged.append(delta)
    return merged
