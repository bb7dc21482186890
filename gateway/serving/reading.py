"""A request's body read into its prompt, the same way for every endpoint: content type, size and deadline checked
first, then the endpoint's own reading of it (a large body's off the event loop: gateway.prompt.workers), timed as
the span's `tokenize` child, and an empty prompt refused."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request

from gateway.api_error import APIError
from gateway.openai.body import check_content_type, read_body
from gateway.openai.request import OpenAIRequest
from gateway.prompt.token_ids import prompt_token_ids
from gateway.serving.streaming import Reply
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller


@dataclass(slots=True)
class Reading:
    """What an endpoint read from a body: the chat or completion request, its prompt's token ids, and how it is
    answered."""

    request: OpenAIRequest
    ids: list[int]
    tokenizing_since: int  # time.time_ns() when tokenizing began, for the span's `tokenize` child
    reply: Reply


class Endpoint(Protocol):
    """What an endpoint (gateway.endpoints) gives the steps every request goes through."""

    name: str  # its label in kvserve_requests_total and in its span: "chat", "completion" or "responses"
    prompt_field: str  # the field an empty prompt's 400 names

    async def read(self, raw: bytes, caller: Caller, models: Collection[str]) -> Reading:
        """The body parsed, validated and tokenized; models: those the caller may name (the first by default)."""
        ...

    def refusal(self, error: APIError) -> APIError:
        """A request refused before it reached an executor, in this endpoint's terms."""
        ...


def tokenized(request: OpenAIRequest, tokenizer) -> tuple[list[int], int]:
    """Its prompt's token ids, and when tokenizing began (ns); in a worker thread for a large body, so it touches
    nothing the event loop's tasks change."""
    started = time.time_ns()
    return prompt_token_ids(request, tokenizer), started


async def read(
    request: Request,
    endpoint: Endpoint,
    caller: Caller,
    models: Collection[str],
    span: RequestSpan,
    body_timeout_s: float,
) -> Reading:
    """The request body, read within the deadline, parsed and validated by its endpoint, with its prompt's ids."""
    check_content_type(request.headers.get("content-type"))
    raw = await read_body(request, body_timeout_s)
    reading = await endpoint.read(raw, caller, models)
    span.child("tokenize", reading.tokenizing_since, {"gen_ai.usage.input_tokens": len(reading.ids)})
    if not reading.ids:
        raise APIError(400, "the prompt is empty", param=endpoint.prompt_field)
    return reading
