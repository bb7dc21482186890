"""POST /v1/responses, served as a chat request: its previous response's conversation read from the store before
its prompt is built, its answer written as a Response (whole or as events), and the Response stored, with the
conversation it continues, before the client hears it is complete."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Collection, Sequence

import redis

from gateway.api_error import APIError
from gateway.openai.body import read_json_body
from gateway.openai.request_limits import RequestLimits
from gateway.openai.responses import Generation
from gateway.openai.responses_api import (
    ResponsesRequest,
    as_responses_error,
    parse_responses_body,
    previous_response_id,
    response_not_found,
)
from gateway.openai.responses_events import (
    ResponseEvents,
    conversation_items,
    output_items,
    response_id,
    response_object,
    usage,
)
from gateway.prompt.workers import PromptWorkers
from gateway.response_store import ResponseStore, StoreFull
from gateway.serving.reading import Reading, tokenized
from gateway.tenants.tenancy import Caller

log = logging.getLogger("kvserve.gateway")


class Responses:
    name = "responses"
    prompt_field = "input"

    def __init__(
        self,
        tokenizer,
        tool_call_parser: str | None,
        limits: RequestLimits,
        workers: PromptWorkers,
        store: ResponseStore,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.limits = limits
        self.workers = workers
        self.store = store

    async def read(self, raw: bytes, caller: Caller, models: Collection[str]) -> Reading:
        """The body names the conversation it continues, read from Redis before its prompt is built."""
        body = await self.workers.run(functools.partial(read_json_body, raw), len(raw))
        items = await history(self.store, caller.tenant.name, body)
        work = functools.partial(self._prompt, body, items, models)
        turn, stored_size, ids, tokenizing_since = await self.workers.run(work, len(raw))
        if turn.store:  # a full store is said before the answer is generated, not found out at the next turn
            await self.store.check_room(caller.tenant.name, stored_size)
        return Reading(turn.chat, ids, tokenizing_since, ResponsesReply(turn, self.store, caller.tenant.name))

    def refusal(self, error: APIError) -> APIError:
        """The chat path's checks name chat's fields; the client knows the Responses request's."""
        return as_responses_error(error)

    def _prompt(
        self, body: dict, items: list[dict], models: Collection[str]
    ) -> tuple[ResponsesRequest, int, list[int], int]:
        """The turn, the bytes its stored record will at least weigh (0: not stored), its prompt's ids and when
        tokenizing began."""
        turn = parse_responses_body(body, items, models, self.tool_call_parser, self.limits)
        # a conversation too large to store is refused before it is answered
        stored_size = self.store.check_size(turn.items) if turn.store else 0
        return turn, stored_size, *tokenized(turn.chat, self.tokenizer)


async def history(store: ResponseStore, tenant: str, body: dict) -> list[dict]:
    """The items of the conversation previous_response_id continues ([] without one); 404 if the caller's tenant
    has no such response. Its instructions are not carried over, as OpenAI documents."""
    previous = previous_response_id(body)
    if previous is None:
        return []
    record = await store.load(tenant, previous)
    if record is None:
        raise response_not_found(previous, "previous_response_id")
    return record["items"]


class ResponsesReply:
    """Answers with a Response; stored (if the request says store) under its caller's tenant."""

    def __init__(self, turn: ResponsesRequest, store: ResponseStore, tenant: str) -> None:
        self.turn = turn
        self.store = store
        self.tenant = tenant
        self.id = response_id()
        self.created_at = int(time.time())

    def events(self, generations: Sequence[Generation]) -> ResponseEvents:
        return ResponseEvents(generations[0], self.id, self.created_at, self.turn.echo)

    async def streamed(self, events: ResponseEvents) -> None:
        await self._save(events.response)

    async def whole(self, generations: Sequence[Generation]) -> dict:
        generation = generations[0]
        status = "incomplete" if generation.finish_reason == "length" else "completed"
        output = output_items(generation)
        response = response_object(
            self.id, self.created_at, generation.model, self.turn.echo, output, status, usage(generation)
        )
        await self._save(response)
        return response

    def error_event(self, events: ResponseEvents, error: APIError) -> str:
        return events.error(error)

    async def _save(self, response: dict) -> None:
        """A store that fails, or that other tenants filled while this was generated, loses the response for later
        turns, not this answer: the client still gets it."""
        if not self.turn.store:
            return
        items = [*self.turn.items, *conversation_items(response["output"])]
        try:
            evicted = await self.store.save(self.tenant, response, items)
        except StoreFull as full:
            log.warning(
                "response %s of tenant %s not stored, the store is full: %s", self.id, self.tenant, full
            )
            return
        except redis.RedisError as error:
            log.error("storing response %s of tenant %s failed: %r", self.id, self.tenant, error)
            return
        if evicted:
            log.info(
                "tenant %s: %d stored responses evicted, oldest first, to store %s",
                self.tenant,
                evicted,
                self.id,
            )
