"""Who is calling, what they may use and whether their budget allows it: the gateway's side of tenancy.

A request's `Authorization: Bearer <key>` names a key record in Redis (gateway.tenants.api_keys), which names the
tenant, its cache salt, its models and its limits. Limits are kept in Redis (gateway.tenants.rate_limits), so
every gateway replica enforces one budget.

Open (every request served as one anonymous tenant) only while this deployment has never had a key, and only
where the operator allows it: a loopback --host, or --allow-anonymous; never with --require-api-key. It fails
closed: once keys exist, neither revoking the last one (Redis keeps a marker, gateway.tenants.api_keys.mark_keyed)
nor a Redis that comes back empty (this process remembers, for its life) opens it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from gateway.api_error import APIError
from gateway.tenants.api_keys import KeyRecord, authenticate, deployment_keyed
from gateway.tenants.rate_limits import Limiter
from shared.tenant import ANONYMOUS_TENANT, Tenant

log = logging.getLogger("kvserve.gateway.tenancy")

# the error's `type` per limit, as OpenAI names the first two (its `code` is rate_limit_exceeded for all)
_LIMIT_TYPES = {"rpm": "requests", "tpm": "tokens", "max_concurrency": "concurrent_requests"}


class NoKeysConfigured(RuntimeError):
    pass


@dataclass(slots=True, frozen=True)
class Caller:
    record: KeyRecord | None  # None: the gateway runs open
    # whose requests it sends, as the executors know them too: its key's tenant, salt and weight
    tenant: Tenant = ANONYMOUS_TENANT

    @classmethod
    def of(cls, record: KeyRecord | None) -> Caller:
        """The caller a key record names; None: the anonymous tenant of an open gateway."""
        if record is None:
            return cls(None)
        return cls(record, Tenant(record.tenant, record.cache_salt, record.weight))

    def models(self, served: Collection[str], adapters: Collection[str] = ()) -> list[str]:
        """The served models this caller may use, then the served LoRA adapters: its key's own (none without
        an `adapters` field); an open gateway's anonymous caller, every one (there is no one to own them)."""
        if self.record is None:
            return [*served, *adapters]
        models = self.record.models
        base = list(served) if models is None else [m for m in served if m in models]
        return base + [a for a in adapters if a in self.record.adapters]


def _redis_unreachable(error: Exception) -> APIError:
    log.error("redis unreachable: %s", error)
    return APIError(503, "the key store (Redis) is unreachable; try again shortly", "server_error")


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", code="invalid_api_key")


REQUIRE_API_KEY_REFUSAL = (
    "--require-api-key: no API key exists in Redis; create one with `kvserve keys create --tenant NAME`"
)
_NO_KEY = (
    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`: this gateway has API keys "
    "configured and serves no request without a valid one."
)


class Tenancy:
    def __init__(self, client: aioredis.Redis, require_api_key: bool, anonymous_allowed: bool = True) -> None:
        """anonymous_allowed: it may run open while no key has ever existed (a loopback --host, or
        --allow-anonymous); --require-api-key never."""
        self.client = client
        self.require_api_key = require_api_key
        # every request needs a valid key from now on; set for this process's life once it has seen keys exist
        self.closed = require_api_key or not anonymous_allowed
        self.limiter = Limiter(client)
        self.leases: dict[str, KeyRecord] = {}  # request id -> key, for requests holding a concurrency slot
        self._refreshing: asyncio.Task | None = None

    async def startup(self) -> None:
        try:
            keyed = await self._keyed()
        except redis.RedisError as error:  # each request checks again; /health reports Redis meanwhile
            log.error("cannot tell whether API keys exist, Redis is unreachable: %s", error)
            keyed = True
        if not keyed and self.require_api_key:
            raise NoKeysConfigured(REQUIRE_API_KEY_REFUSAL)
        if not keyed and self.closed:
            log.error(
                "no API key exists in Redis and this gateway may not run open: every request gets 401 until "
                "one is created with `kvserve keys create --tenant NAME`"
            )
        elif not keyed:
            banner = "!" * 100
            log.warning(banner)
            log.warning(
                "NO API KEYS CONFIGURED: this gateway serves ANYONE who can reach it, without limits or cache "
                "isolation. Create keys with `kvserve keys create --tenant NAME` (requests then need one, for "
                "good), or start with --require-api-key."
            )
            log.warning(banner)
        self._refreshing = asyncio.create_task(self._refresh_leases())

    async def shutdown(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()

    async def identify(self, headers) -> Caller:
        """The caller a request's headers name; 401 for a missing, unknown or revoked key when keys exist.
        An open gateway ignores whatever key comes (OpenAI's SDKs insist on sending one)."""
        try:
            return await self._identify(headers)
        except redis.RedisError as error:
            raise _redis_unreachable(error) from None

    async def _identify(self, headers) -> Caller:
        header = headers.get("authorization")
        if header is None:
            if await self._open():
                return Caller.of(None)
            raise _unauthorized(_NO_KEY)
        scheme, _, presented = header.partition(" ")
        record = None
        if scheme.lower() == "bearer" and presented.strip():
            record = await authenticate(self.client, presented.strip())
        if record is not None:
            self._close()
            return Caller.of(record)
        if await self._open():
            return Caller.of(None)
        if scheme.lower() != "bearer":
            raise _unauthorized("The Authorization header must be `Bearer <key>`.")
        raise _unauthorized("Incorrect API key provided, or it has been revoked.")

    async def _open(self) -> bool:
        """Whether a request without a valid key is served, as the anonymous tenant. Once closed, Redis is not
        asked: a flood of keyless requests costs it nothing."""
        return not self.closed and not await self._keyed()

    async def _keyed(self) -> bool:
        keyed = await deployment_keyed(self.client)
        if keyed:
            self._close()
        return keyed

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            log.info("API keys exist: from now on this gateway serves only requests with a valid one")

    async def serves_anonymously(self) -> bool:
        """Whether this gateway is open, so every request it has served was the anonymous tenant's (its
        metrics name no one). Redis unreachable: yes as long as it has never seen a key."""
        try:
            return await self._open()
        except redis.RedisError:
            return not self.closed

    async def admit(self, caller: Caller, request_id: str, reserve_tokens: int) -> None:
        """Take the request's share of the caller's limits, or raise a 429 saying which limit and when."""
        if caller.record is None:
            return
        try:
            admission = await self.limiter.admit(caller.record, request_id, reserve_tokens)
        except redis.RedisError as error:
            raise _redis_unreachable(error) from None
        if not admission.admitted:
            try:  # best-effort: the caller is told of its limit whether or not Redis takes the count
                await self.limiter.count_rejected(caller.record, request_id)
            except redis.RedisError as error:
                log.warning("tenant %s's refused request not counted: %s", caller.tenant.name, error)
            retry_after = max(1, math.ceil(admission.retry_after_s))
            raise APIError(
                429,
                admission.message,
                _LIMIT_TYPES[admission.limit],
                code="rate_limit_exceeded",
                headers={"retry-after": str(retry_after)},
            )
        if caller.record.max_concurrency is not None:
            self.leases[request_id] = caller.record

    @contextlib.asynccontextmanager
    async def admitted(self, caller: Caller) -> AsyncIterator[None]:
        """A request that generates nothing (a stored response's read or delete): one request of the caller's
        limits, no tokens, and a concurrency slot while it runs; a 429 as admit's."""
        request_id = uuid.uuid4().hex
        await self.admit(caller, request_id, 0)
        try:
            yield
        finally:
            if request_id in self.leases:
                try:
                    await self.withdraw(caller, request_id, 0)
                except redis.RedisError as error:  # the slot's lease lapses on its own
                    log.warning("freeing tenant %s's concurrency slot failed: %s", caller.tenant.name, error)

    async def release(
        self,
        caller: Caller,
        request_id: str,
        reserved_tokens: int,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        kv_block_seconds: float = 0.0,
        cached_from: Mapping[str, int] | None = None,
        adapter: str | None = None,
    ) -> None:
        """Give back the slot and the unused reservation, and count the tenant's usage (adapter: the LoRA
        adapter it ran under, counted apart too)."""
        if caller.record is None:
            return
        self.leases.pop(request_id, None)
        await self.limiter.release(
            caller.record,
            request_id,
            reserved_tokens,
            prompt_tokens + completion_tokens,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            kv_block_seconds=kv_block_seconds,
            cached_from=cached_from,
            adapter=adapter,
        )

    async def withdraw(self, caller: Caller, request_id: str, reserved_tokens: int) -> None:
        """Give back all an admitted request took, when it was refused before reaching an executor."""
        if caller.record is None:
            return
        self.leases.pop(request_id, None)
        await self.limiter.withdraw(caller.record, request_id, reserved_tokens)

    async def count_kv_block_seconds(self, caller: Caller, request_id: str, kv_block_seconds: float) -> None:
        """Add to the tenant's usage what an aborted request's KV held, told after the request ended."""
        if caller.record is not None:
            await self.limiter.count_kv_block_seconds(caller.record, request_id, kv_block_seconds)

    async def _refresh_leases(self) -> None:
        """Keep running requests' concurrency slots alive; a dead gateway's slots lapse on their own."""
        while True:
            await asyncio.sleep(self.limiter.LEASE_S / 3)
            if not self.leases:
                continue
            try:
                await self.limiter.refresh([(record, rid) for rid, record in self.leases.items()])
            except Exception as error:  # the next round tries again; the lease outlives two misses
                log.warning("refreshing concurrency leases failed: %s", error)
