"""POST /v1/chat/completions and /v1/completions: one endpoint each, differing only in how their body is parsed
(messages rendered through the model's chat template, or a text prompt or its token ids as it is); both are
answered as a chat.completion / text_completion or its chunks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

from gateway.api_error import APIError
from gateway.openai.request import OpenAIRequest, parse_chat_request, parse_completion_request
from gateway.openai.request_limits import RequestLimits
from gateway.openai.responses import ChatReply
from gateway.prompt.workers import PromptWorkers
from gateway.serving.reading import Reading, tokenized
from gateway.tenants.tenancy import Caller


class CompletionEndpoint:
    def __init__(
        self,
        name: str,
        prompt_field: str,
        parse: Callable[[bytes, Collection[str]], OpenAIRequest],
        tokenizer,
        workers: PromptWorkers,
    ) -> None:
        self.name = name
        self.prompt_field = prompt_field
        self.parse = parse
        self.tokenizer = tokenizer
        self.workers = workers

    async def read(self, raw: bytes, caller: Caller, models: Collection[str]) -> Reading:
        work = functools.partial(self._prompt, raw, models)
        parsed, ids, tokenizing_since = await self.workers.run(work, len(raw))
        return Reading(parsed, ids, tokenizing_since, ChatReply(parsed.include_usage))

    def refusal(self, error: APIError) -> APIError:
        return error

    def _prompt(self, raw: bytes, models: Collection[str]) -> tuple[OpenAIRequest, list[int], int]:
        parsed = self.parse(raw, models)
        return parsed, *tokenized(parsed, self.tokenizer)


def chat_completions(
    tokenizer, tool_call_parser: str | None, limits: RequestLimits, workers: PromptWorkers
) -> CompletionEndpoint:
    """POST /v1/chat/completions: `tool_call_parser` reads tool_choice "auto"'s calls (None refuses "auto")."""
    parse = functools.partial(parse_chat_request, tool_call_parser=tool_call_parser, limits=limits)
    return CompletionEndpoint("chat", "messages", parse, tokenizer, workers)


def text_completions(tokenizer, limits: RequestLimits, workers: PromptWorkers) -> CompletionEndpoint:
    """POST /v1/completions."""
    parse = functools.partial(parse_completion_request, limits=limits)
    return CompletionEndpoint("completion", "prompt", parse, tokenizer, workers)
