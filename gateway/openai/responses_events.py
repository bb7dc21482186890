"""The Responses API's answer: the Response object, whole or as its typed server-sent events (response.created,
response.output_item.added, response.output_text.delta, response.function_call_arguments.delta, ...,
response.completed), each numbered by sequence_number, from the same Generation a chat answer reads
(gateway/openai/responses.py), so the parsing of text and tool calls is one."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping, Sequence

from gateway.api_error import APIError
from gateway.openai.responses import Delta, Generation
from gateway.openai.tool_parser import ToolCallDelta


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def usage(generation: Generation) -> dict:
    """cache_write_tokens: the prompt tokens prefilled, which the prefix cache then holds (but for a last partial
    block, whose size the gateway does not track per request)."""
    output_tokens = generation.output.num_tokens
    cached = generation.cached_tokens
    return {
        "input_tokens": generation.num_prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": generation.num_prompt_tokens - cached,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": generation.num_prompt_tokens + output_tokens,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(
    id: str,
    created_at: int,
    model: str,
    echo: dict,
    output: list[dict],
    status: str,
    usage: dict | None = None,
) -> dict:
    """OpenAI's Response; echo: the request's fields it repeats (gateway.openai.responses_api)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "usage": usage,
        **echo,
    }


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(generation: Generation) -> list[dict]:
    """A whole answer's output: its text as one message (if any, or if there is nothing else), then its calls."""
    status = _status(generation.finish_reason)
    parser = generation.tool_calls
    text = generation.output.text if parser is None else parser.content
    calls = parser.calls if parser is not None else []
    items = [_message_item("msg_" + uuid.uuid4().hex, text, status)] if text or not calls else []
    for call in calls:
        items.append(_call_item("fc_" + uuid.uuid4().hex, call.id, call.name, call.arguments, status))
    return items


def conversation_items(output: list[dict]) -> list[dict]:
    """Output items in the plain form a stored conversation keeps (gateway.openai.responses_api)."""
    items = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        else:
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def sse_event(event: dict) -> str:
    """Responses events name their type on an `event:` line too, as OpenAI sends them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ResponseEvents:
    """One response's events as its generation grows: the same update() and `finished` as chat's EventStream,
    so gateway.serving.streaming streams either. Items open as their first text or call arrives and close when
    the next one opens or the output ends; `response` is the whole Response once finished."""

    def __init__(self, generation: Generation, id: str, created_at: int, echo: dict) -> None:
        self.generation = generation
        self.id, self.created_at, self.echo = id, created_at, echo
        self.output: list[dict] = []
        self.response: dict | None = None
        self._open: dict | None = None  # the item being written
        self._sequence = 0
        self._started = False

    @property
    def finished(self) -> bool:
        return self.response is not None

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(event)

    def _snapshot(self, status: str, usage: dict | None = None) -> dict:
        model = self.generation.model
        return response_object(self.id, self.created_at, model, self.echo, list(self.output), status, usage)

    def update(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[object | None] | None,
        finish_reason: str | None,
        cached_tokens: int,
        index: int = 0,
        prompt_logprobs: Sequence[object] | None = None,
        cached_from: Mapping[str, int] | None = None,
    ) -> str:
        if self.finished:
            return ""
        events = []
        if not self._started:
            self._started = True
            events.append(self._event("response.created", response=self._snapshot("in_progress")))
            events.append(self._event("response.in_progress", response=self._snapshot("in_progress")))
        delta = self.generation.feed(
            token_ids, logprobs, finish_reason, cached_tokens, prompt_logprobs, cached_from
        )
        events += self._deltas(delta)
        if delta.finish_reason is not None:
            status = _status(delta.finish_reason)
            events += self._close(status)
            self.response = self._snapshot(status, usage(self.generation))
            kind = "response.completed" if status == "completed" else "response.incomplete"
            events.append(self._event(kind, response=self.response))
        return "".join(events)

    def _deltas(self, delta: Delta) -> list[str]:
        events = []
        if delta.text:
            if self._open is None or self._open["type"] != "message":
                events += self._open_message()
            self._open["content"][0]["text"] += delta.text
            events.append(
                self._event("response.output_text.delta", **self._where(), delta=delta.text, logprobs=[])
            )
        for call in delta.tool_calls:
            events += self._call_delta(call)
        if delta.finish_reason is not None and not self.output and self._open is None:
            events += self._open_message()  # an empty answer is an empty message, as a whole one is
        return events

    def _open_message(self) -> list[str]:
        events = self._close("completed")
        events += self._open_item(_message_item("msg_" + uuid.uuid4().hex, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._event("response.content_part.added", **self._where(), part=part))
        return events

    def _call_delta(self, call: ToolCallDelta) -> list[str]:
        events = []
        if call.id is not None:  # a new call: its item opens
            events += self._close("completed")
            item = _call_item("fc_" + uuid.uuid4().hex, call.id, call.name, "", "in_progress")
            events += self._open_item(item)
        if call.arguments:
            self._open["arguments"] += call.arguments
            where = self._where(content=False)
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
            )
        return events

    def _where(self, content: bool = True) -> dict:
        where = {"item_id": self._open["id"], "output_index": len(self.output)}
        return where | {"content_index": 0} if content else where

    def _open_item(self, item: dict) -> list[str]:
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output), item=_copy(item))]

    def _close(self, status: str) -> list[str]:
        """The open item's closing events; it joins the output."""
        item, events = self._open, []
        if item is None:
            return events
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            events.append(self._event("response.output_text.done", **self._where(), text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **self._where(), part=_copy(part)))
        else:
            arguments = item["arguments"]
            where = self._where(content=False)
            events.append(self._event("response.function_call_arguments.done", **where, arguments=arguments))
        events.append(
            self._event("response.output_item.done", output_index=len(self.output), item=_copy(item))
        )
        self.output.append(item)
        self._open = None
        return events

    def error(self, error: APIError) -> str:
        """A failure after the stream began: OpenAI's error event (the status line has gone out already)."""
        return self._event("error", code=error.code or error.type, message=error.message, param=error.param)


def _copy(item: dict) -> dict:
    """An event carries the item as it is then; the open item goes on changing."""
    return copy.deepcopy(item)
