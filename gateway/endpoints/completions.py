"""POST /v1/completions: a text prompt (or its token ids) as it is, answered as a text_completion or its chunks."""

from __future__ import annotations

import functools

from gateway.api_error import APIError
from gateway.openai.request import OpenAIRequest, parse_completion_request
from gateway.openai.request_limits import RequestLimits
from gateway.openai.responses import ChatReply
from gateway.prompt.workers import PromptWorkers
from gateway.serving.reading import Reading, tokenized
from gateway.tenants.tenancy import Caller


class TextCompletions:
    name = "completion"
    prompt_field = "prompt"

    def __init__(self, model_name: str, tokenizer, limits: RequestLimits, workers: PromptWorkers) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.workers = workers

    async def read(self, raw: bytes, caller: Caller) -> Reading:
        work = functools.partial(self._prompt, raw)
        parsed, ids, tokenizing_since = await self.workers.run(work, len(raw))
        return Reading(parsed, ids, tokenizing_since, ChatReply(parsed.include_usage))

    def refusal(self, error: APIError) -> APIError:
        return error

    def _prompt(self, raw: bytes) -> tuple[OpenAIRequest, list[int], int]:
        parsed = parse_completion_request(raw, [self.model_name], self.limits)
        return parsed, *tokenized(parsed, self.tokenizer)
