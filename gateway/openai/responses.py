"""OpenAI response objects, whole or as server-sent events, from the executor's per-step token updates."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.api_error import APIError
from gateway.openai.logprobs import LogprobFormatter, TokenLogprob, logprob_formatter, token_logprob
from gateway.openai.output_text import OutputText
from gateway.openai.request import Endpoint, OpenAIRequest
from gateway.openai.sse import sse_data
from gateway.openai.tool_parser import ToolCallDelta, ToolCallParser

DONE_EVENT = "data: [DONE]\n\n"


@dataclass(slots=True)
class Delta:
    """What one update released: text, the logprobs of the tokens it completes, and the end if it came."""

    text: str
    logprobs: list[TokenLogprob]
    text_offset: int  # where text starts in the whole output, echoed prompt included (completions' logprobs)
    finish_reason: str | None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class Generation:
    """One request's output as it grows; streaming and whole responses both read it, so they cannot differ."""

    endpoint: Endpoint
    model: str
    num_prompt_tokens: int
    output: OutputText
    formatter: LogprobFormatter
    want_logprobs: bool
    tool_calls: ToolCallParser | None = (
        None  # a chat request with tools: the output's text is parsed for calls
    )
    index: int = 0  # the choice it is (n > 1: each choice is a Generation of its own, under one id)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # prompt logprobs: echo (completions) puts the prompt's text, and with logprobs its tokens' columns, before
    # the output's; prompt_logprobs_top is vLLM's extension as asked, its list on the choice (chat: the response)
    echo: str | None = None
    prompt_token_ids: Sequence[int] = ()
    num_top_logprobs: int = 0
    prompt_logprobs_top: int | None = None
    scored_prompt: list[TokenLogprob] | None = field(default=None, init=False)  # the first token's is empty
    cached_tokens: int = field(default=0, init=False)
    # of those, the ones loaded from a KV tier below the executor's pool or pulled from a peer, by source
    # (shared.cache_sources): the tenant's usage splits cached_tokens by them
    cached_from: Mapping[str, int] = field(default_factory=dict, init=False)
    finish_reason: str | None = field(default=None, init=False)
    logprobs: list[TokenLogprob] = field(default_factory=list, init=False)  # of the output's tokens so far
    _pending: list[TokenLogprob] = field(default_factory=list, init=False, repr=False)  # held back with text

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + uuid.uuid4().hex

    @classmethod
    def start_all(
        cls, request: OpenAIRequest, prompt_token_ids: Sequence[int], stop: Sequence[str], tokenizer
    ) -> list[Generation]:
        """Every choice the request asks for (its sampling's n), one id and creation time for all."""
        first = cls.start(request, prompt_token_ids, stop, tokenizer)
        others = [
            cls.start(request, prompt_token_ids, stop, tokenizer, i) for i in range(1, request.sampling.n)
        ]
        for other in others:
            other.id, other.created = first.id, first.created
        return [first, *others]

    @classmethod
    def start(
        cls,
        request: OpenAIRequest,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        tokenizer,
        index: int = 0,
    ) -> Generation:
        """stop comes from the final SamplingParams (already a list)."""
        tools = request.tools
        echo = None
        if request.echo:  # a text prompt is echoed as sent; token ids as they decode
            echo = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt_token_ids)
        return cls(
            request.endpoint,
            request.model,
            len(prompt_token_ids),
            OutputText(tokenizer, prompt_token_ids, stop),
            logprob_formatter(tokenizer),
            request.sampling.logprobs is not None,
            None
            if tools is None
            else ToolCallParser(tools.names, tools.constrained, None if tools.parallel else 1),
            echo=echo,
            prompt_token_ids=prompt_token_ids,
            num_top_logprobs=request.sampling.logprobs or 0,
            prompt_logprobs_top=request.prompt_logprobs,
            index=index,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_matched(self) -> bool:
        """A stop string ended the output: the executor is still generating and must be aborted."""
        return self.output.stopped

    def feed(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[object | None] | None,  # wire lists or TokenLogprobs objects, one per token
        finish_reason: str | None,
        cached_tokens: int,
        prompt_logprobs: Sequence[object] | None = None,  # the prompt's, but its first token's (comes once)
        cached_from: Mapping[str, int] | None = None,
    ) -> Delta:
        """Apply one executor update; after the output has ended, updates change nothing."""
        if self.finished:
            return Delta("", [], self.output.num_chars, None)
        self.cached_tokens, self.cached_from = cached_tokens, cached_from or {}
        if prompt_logprobs is not None:
            first = TokenLogprob(self.prompt_token_ids[0], None, None)
            self.scored_prompt = [first, *map(token_logprob, prompt_logprobs)]
        offset = len(self.echo or "") + self.output.num_chars
        text = self.output.add(token_ids, finished=finish_reason is not None)
        if self.output.stopped:
            finish_reason = (
                "stop"  # OpenAI reports a matched stop string as "stop", whatever the executor said
            )
        calls: list[ToolCallDelta] = []
        if self.tool_calls is not None:
            text, calls = self.tool_calls.feed(text, finished=finish_reason is not None)
            if finish_reason == "stop" and self.tool_calls.calls:
                finish_reason = "tool_calls"  # a cut-short call keeps "length"
        if self.want_logprobs and logprobs:
            self._pending.extend(token_logprob(entry) for entry in logprobs if entry is not None)
        released: list[TokenLogprob] = []
        if text or calls or finish_reason is not None:  # held-back tokens' logprobs travel with their output
            released, self._pending = self._pending, []
            self.logprobs.extend(released)
        self.finish_reason = finish_reason
        return Delta(text, released, offset, finish_reason, calls)

    def message(self) -> dict:
        """The whole chat answer: its text, or with tools the text around the calls (null if none) and them."""
        if self.tool_calls is None:
            return {"role": "assistant", "content": self.output.text}
        calls = [call.message_entry() for call in self.tool_calls.calls]
        if not calls:
            return {"role": "assistant", "content": self.tool_calls.content}
        return {"role": "assistant", "content": self.tool_calls.content or None, "tool_calls": calls}

    def usage(self) -> dict:
        return usage([self])

    def echo_entries(self) -> list[TokenLogprob]:
        """The prompt's tokens as echo's logprobs columns show them: the first with neither logprob nor top."""
        if not self.echo:
            return []
        if self.scored_prompt is None:  # not scored (echo without logprobs): the tokens alone
            return [TokenLogprob(t, None, None) for t in self.prompt_token_ids]
        return [entry.cut(self.num_top_logprobs) for entry in self.scored_prompt]

    def prompt_logprobs(self) -> dict:
        """{"prompt_logprobs": [...]} when vLLM's extension was asked (and the prompt scored), else {}."""
        if self.prompt_logprobs_top is None or self.scored_prompt is None:
            return {}
        return {
            "prompt_logprobs": self.formatter.prompt_logprobs(self.scored_prompt, self.prompt_logprobs_top)
        }

    def logprobs_object(self, entries: Sequence[TokenLogprob], text_offset: int) -> dict | None:
        """None (JSON null) unless logprobs were asked for, as OpenAI answers."""
        if not self.want_logprobs:
            return None
        if self.endpoint == "chat":
            return self.formatter.chat(entries)
        return self.formatter.completion(entries, text_offset)


def usage(choices: Sequence[Generation]) -> dict:
    """The prompt counted once, however many choices were sampled from it; their completions all counted."""
    first = choices[0]
    completion_tokens = sum(c.output.num_tokens for c in choices)
    return {
        "prompt_tokens": first.num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": first.num_prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _choices(generation: Generation | Sequence[Generation]) -> list[Generation]:
    return [generation] if isinstance(generation, Generation) else list(generation)


def response_body(generation: Generation | Sequence[Generation]) -> dict:
    """The non-streaming answer: chat.completion or text_completion, once every choice has finished."""
    generations = _choices(generation)
    first = generations[0]
    choices = []
    for gen in generations:
        logprobs = gen.logprobs_object(gen.echo_entries() + gen.logprobs, 0)
        if gen.endpoint == "chat":
            choice = {"index": gen.index, "message": gen.message()}
            choices.append(choice | {"logprobs": logprobs, "finish_reason": gen.finish_reason})
        else:
            text = (gen.echo or "") + gen.output.text
            choice = {
                "index": gen.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
            }
            choices.append(choice | gen.prompt_logprobs())
    body = {
        "id": first.id,
        "object": "chat.completion" if first.endpoint == "chat" else "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": usage(generations),
    }
    if first.endpoint == "chat":
        body |= first.prompt_logprobs()  # vLLM puts a chat's on the response
    return body


class EventStream:
    """Server-sent events as OpenAI sends them: (chat) a role chunk first, content chunks, a finish chunk with an
    empty delta, the usage chunk with `choices: []` if include_usage, then `data: [DONE]`."""

    def __init__(self, generation: Generation | Sequence[Generation], include_usage: bool) -> None:
        self.choices = _choices(generation)  # n > 1: each choice's chunks carry its index, usage comes once
        self.generation = self.choices[0]
        self.include_usage = include_usage
        self._started: set[int] = set()

    def _chunk(self, choices: list[dict], usage: dict | None = None, extra: dict | None = None) -> str:
        chat = self.generation.endpoint == "chat"
        payload = {
            "id": self.generation.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.generation.created,
            "model": self.generation.model,
            "choices": choices,
        }
        if self.include_usage:  # OpenAI then sends `usage: null` on every chunk but the last
            payload["usage"] = usage
        return sse_data(payload | (extra or {}))

    def _choice(
        self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None, tool_calls=()
    ) -> dict:
        if self.generation.endpoint == "chat":
            delta = {} if text is None else {"content": text}
            if tool_calls:
                delta = {"tool_calls": [call.chunk_entry() for call in tool_calls]}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    @property
    def finished(self) -> bool:
        """Every choice has ended (and [DONE] gone out)."""
        return all(c.finished for c in self.choices)

    def update(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[object | None] | None,  # wire lists or TokenLogprobs objects, one per token
        finish_reason: str | None,
        cached_tokens: int,
        index: int = 0,
        prompt_logprobs: Sequence[object] | None = None,
        cached_from: Mapping[str, int] | None = None,
    ) -> str:
        """The events one executor update of choice index produces (possibly none); once every choice has
        ended, the usage chunk (if asked for) and [DONE]."""
        generation = self.choices[index]
        if generation.finished:
            return ""
        events = []
        delta = generation.feed(
            token_ids, logprobs, finish_reason, cached_tokens, prompt_logprobs, cached_from
        )
        if index not in self._started and generation.endpoint == "chat":
            role = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
            events.append(self._chunk([choice], extra=generation.prompt_logprobs()))
        elif index not in self._started and (generation.echo or generation.prompt_logprobs_top is not None):
            echoed = generation.logprobs_object(generation.echo_entries(), 0) if generation.echo else None
            choice = self._choice(index, generation.echo or "", echoed, None) | generation.prompt_logprobs()
            events.append(self._chunk([choice]))  # the prompt comes first
        self._started.add(index)
        logprobs_object = (
            generation.logprobs_object(delta.logprobs, delta.text_offset) if delta.logprobs else None
        )
        if delta.text:
            events.append(self._chunk([self._choice(index, delta.text, logprobs_object, None)]))
            logprobs_object = None
        if delta.tool_calls:
            events.append(self._chunk([self._choice(index, None, logprobs_object, None, delta.tool_calls)]))
            logprobs_object = None
        if delta.finish_reason is not None:
            events.append(self._chunk([self._choice(index, None, logprobs_object, delta.finish_reason)]))
            if self.finished:
                if self.include_usage:
                    events.append(self._chunk([], usage(self.choices)))
                events.append(DONE_EVENT)
        return "".join(events)


class ChatReply:
    """How chat and text completions answer, for gateway.serving.streaming; a /v1/responses request answers with
    a ResponsesReply (gateway/endpoints/responses.py), which has the same methods."""

    def __init__(self, include_usage: bool) -> None:
        self.include_usage = include_usage

    def events(self, generations: list[Generation]) -> EventStream:
        return EventStream(generations, self.include_usage)

    async def streamed(self, events: EventStream) -> None:
        """Called once every choice has ended, before the stream's last events go out."""

    async def whole(self, generations: list[Generation]) -> dict:
        return response_body(generations)

    def error_event(self, events: EventStream, error: APIError) -> str:
        return error.sse_event()
