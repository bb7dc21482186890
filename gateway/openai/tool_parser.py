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

import copy
import uuid
from dataclasses import dataclass, field

from gateway.openai.tool_call_scan import CallScan, CallText
from shared.growing_text import GrowingText

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    # its arguments object's text, exactly as the model wrote it (what the stream sent)
    written: GrowingText = field(default_factory=GrowingText)

    @property
    def arguments(self) -> str:
        return self.written.value()

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
class _OpenCall:
    """The call being read: its text so far, how far it is read, and what of it has streamed."""

    space_before: str = ""  # whitespace held before its tag: content again if it turns out not to be a call
    text: CallText = field(default_factory=CallText)
    tail: str = ""  # the text's last characters: where a closing tag that has begun can be
    # of the text but what may be the start of a closing tag
    scan: CallScan = field(default_factory=CallScan)
    index: int | None = None  # set once it is a call (its name streamed)
    sent_arguments: int = 0  # characters of its arguments streamed

    def take(self, new: str, tagged: bool) -> str | None:
        """Add new text up to the closing tag (a tagged call has one); what follows the tag, None if none came."""
        window = self.tail + new
        end = window.find(TOOL_CALL_END) if tagged else -1
        if end < 0:
            self.text.append(new)
            self.tail = window[-(len(TOOL_CALL_END) - 1) :]
            return None
        before_tag = end - len(self.tail)  # of new; negative when the tag began in text already taken
        if before_tag >= 0:
            self.text.append(new[:before_tag])
        else:
            self.text.truncate(self.text.length + before_tag)
        return window[end + len(TOOL_CALL_END) :]

    def read(self, may_end_in_tag: bool) -> CallScan:
        """The scan of the whole text so far. The characters that may yet turn out to begin the closing tag
        (which would take them back) are read on a copy: a few, however long the text."""
        held = _partial_tag(self.tail, TOOL_CALL_END) if may_end_in_tag else 0
        self.scan.read(self.text, self.text.length - held)
        if not held:
            return self.scan
        ahead = copy.copy(self.scan)
        ahead.read(self.text, self.text.length)
        return ahead


@dataclass
class ToolCallParser:
    """Feed it the output's text as it is released; it answers with the content and the tool-call deltas that
    text completes. `names`: the functions the request offered; `constrained`: the output is one call's JSON
    with no tags; `max_calls`: parallel_tool_calls false allows one, and drops what follows it.

    A piece costs what its own length (and the tags') costs, never the text before it: a call's text is read
    once, character by character, as it grows, and what has been released is kept in pieces."""

    names: list[str]
    constrained: bool = False
    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    _released: GrowingText = field(default_factory=GrowingText)  # content
    _pending: str = (
        ""  # text outside calls not yet classified: a tag's first characters at most, between pieces
    )
    _space: list[str] = field(
        default_factory=list
    )  # whitespace held back: content only if more follows (or no call)
    _after_call: bool = False  # whitespace right after a call is not content
    _open: _OpenCall | None = None
    _plain: bool = False  # a constrained output that is not a call: the rest is content as it comes
    _done: bool = False  # max_calls reached, or a constrained call closed: the rest is dropped

    def __post_init__(self) -> None:
        if self.constrained:
            self._open = _OpenCall()

    @property
    def content(self) -> str:
        """Released so far."""
        return self._released.value()

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content released, tool-call deltas) for this piece of the output; finished: it is the last."""
        content, deltas = "", []
        while not self._done:
            if self._plain:
                content += self._content(text)
                break
            if self._open is None:
                self._pending += text
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if finished else _partial_tag(self._pending, TOOL_CALL_START)
                    content += self._content(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content += self._content(self._pending[:start])
                # whitespace before a call is not content
                self._open = _OpenCall(space_before=self._take_space())
                text, self._pending = self._pending[start + len(TOOL_CALL_START) :], ""
                continue
            call = self._open
            after_tag = call.take(text, tagged=not self.constrained)
            scan = call.read(may_end_in_tag=not self.constrained and after_tag is None)
            deltas += self._stream(call, scan)
            # untagged, a prefix that is not JSON can never become a call; tagged, it may be the closing tag
            closed = after_tag is not None or finished or (self.constrained and scan.state != "partial")
            if not closed:
                break
            text = after_tag or ""
            content += self._close(call, scan, after_tag is not None, deltas)
        if finished:
            space = self._take_space()
            if not self.calls:  # a text answer keeps its trailing whitespace
                content += space
                self._released.append(space)
        return content, _merged(deltas)

    def _take_space(self) -> str:
        """The whitespace held back, no longer held."""
        space = "".join(self._space)
        self._space.clear()
        return space

    def _content(self, text: str) -> str:
        """Text outside calls, less the whitespace that only separates it from calls."""
        if text.isspace() or not text:  # held (all of it is whitespace), or dropped right after a call
            if self._after_call:
                self._space.clear()
            elif text:
                self._space.append(text)
            return ""
        held = self._take_space() + text
        if self._after_call:
            held = held.lstrip()
        released = held.rstrip()
        if held[len(released) :]:
            self._space.append(held[len(released) :])
        if released:
            self._after_call = False
            self._released.append(released)
        return released

    def _stream(self, call: _OpenCall, scan: CallScan) -> list[ToolCallDelta]:
        deltas = []
        if call.index is None:
            started = scan.arguments_start is not None or scan.state == "complete"
            if scan.state == "invalid" or scan.name not in self.names or not started:
                return deltas
            call.index = len(self.calls)
            self.calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], scan.name))
            deltas.append(ToolCallDelta(call.index, "", self.calls[-1].id, scan.name))
        if scan.state != "invalid" and scan.arguments_start is not None:
            end = scan.arguments_end if scan.arguments_end is not None else call.text.length
            if end - scan.arguments_start > call.sent_arguments:
                written = call.text.slice(scan.arguments_start + call.sent_arguments, end)
                deltas.append(ToolCallDelta(call.index, written))
                self.calls[call.index].written.append(written)
                call.sent_arguments = end - scan.arguments_start
        return deltas

    def _close(self, call: _OpenCall, scan: CallScan, tagged: bool, deltas: list[ToolCallDelta]) -> str:
        """A block has ended: a call is finished; anything else is content after all, tags and all."""
        self._open = None
        if call.index is None:
            if self.constrained:
                self._plain = True
                return self._content(call.text.value())
            self._space = [call.space_before]
            return self._content(TOOL_CALL_START + call.text.value() + (TOOL_CALL_END if tagged else ""))
        if not self.calls[call.index].arguments:  # {"name": "f"}: a call without arguments
            deltas.append(ToolCallDelta(call.index, "{}"))
            self.calls[call.index].written.append("{}")
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
