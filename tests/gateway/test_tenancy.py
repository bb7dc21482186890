"""The gateway's reading of who calls: open until a key exists, keys checked after, Redis trouble as a 503."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from starlette.testclient import TestClient

from gateway.api_error import APIError
from gateway.app import GatewayConfig, build_app
from gateway.tenants.api_keys import KeyStore
from gateway.tenants.tenancy import Caller, NoKeysConfigured, Tenancy
from shared.tenant import ANONYMOUS_TENANT

DB = 11  # a database of its own: whether any key exists is the question here


@pytest.fixture
def db_url(redis_url):
    url = redis_url.rsplit("/", 1)[0] + f"/{DB}"
    redis.Redis.from_url(url).flushdb()
    yield url
    redis.Redis.from_url(url).flushdb()


def identify(url: str, headers: dict, require: bool = False):
    async def run():
        client = aioredis.from_url(url)
        try:
            return await Tenancy(client, require).identify(headers)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_open_until_a_key_exists_then_keys_are_checked(db_url):
    # open: no key needed, and whatever key an SDK insists on sending is ignored
    assert identify(db_url, {}).tenant == ANONYMOUS_TENANT
    assert identify(db_url, {"authorization": "Bearer sk-anything"}).tenant == ANONYMOUS_TENANT
    with pytest.raises(APIError) as refused:
        identify(db_url, {}, require=True)
    assert refused.value.status == 401
    key, _ = KeyStore(redis.Redis.from_url(db_url)).create(f"t-{uuid.uuid4().hex[:6]}")
    caller = identify(db_url, {"authorization": f"Bearer {key}"})
    assert caller.tenant.name.startswith("t-") and caller.tenant.cache_salt == caller.record.cache_salt
    for headers in ({}, {"authorization": "Bearer sk-anything"}, {"authorization": f"Basic {key}"}):
        with pytest.raises(APIError) as refused:
            identify(db_url, headers)
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"


def test_models_a_caller_may_use(db_url):
    store = KeyStore(redis.Redis.from_url(db_url))
    key, _ = store.create("m-tenant", models=["a", "c"])
    caller = identify(db_url, {"authorization": f"Bearer {key}"})
    assert caller.models(["a", "b", "c"]) == ["a", "c"]
    anonymous = identify(db_url.rsplit("/", 1)[0] + "/12", {})
    assert anonymous.models(["a", "b"]) == ["a", "b"]


def test_unreachable_redis_is_a_503_in_openai_shape(tokenizer):
    config = GatewayConfig("redis://127.0.0.1:1/0", "tiny", tokenizer)
    with TestClient(build_app(config)) as client:  # starts even so: /health says what is wrong
        assert client.get("/health").status_code == 503
        response = client.post(
            "/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer x"}
        )
        assert response.status_code == 503
        assert "Redis" in response.json()["error"]["message"]


def test_an_open_gateway_says_so_loudly_and_a_required_one_refuses(db_url, caplog):
    async def start(require: bool) -> None:
        client = aioredis.from_url(db_url)
        tenancy = Tenancy(client, require)
        try:
            await tenancy.startup()
        finally:
            await tenancy.shutdown()
            await client.aclose()

    with caplog.at_level("WARNING", logger="kvserve.gateway.tenancy"):
        asyncio.run(start(require=False))
    assert any("NO API KEYS CONFIGURED" in r.getMessage() for r in caplog.records)
    with pytest.raises(NoKeysConfigured):
        asyncio.run(start(require=True))
    KeyStore(redis.Redis.from_url(db_url)).create("someone")
    caplog.clear()
    asyncio.run(start(require=True))
    assert not any("NO API KEYS" in r.getMessage() for r in caplog.records)


def test_once_keys_existed_it_never_opens_again(db_url):
    async def run() -> None:
        client = aioredis.from_url(db_url)
        try:
            tenancy = Tenancy(client, False)
            assert (
                await tenancy.identify({})
            ).tenant == ANONYMOUS_TENANT and await tenancy.serves_anonymously()
            store = KeyStore(redis.Redis.from_url(db_url))
            _, record = store.create("t-latch")
            store.revoke(record.key_id)  # the last key: the marker keeps the deployment keyed
            for fresh in (tenancy, Tenancy(client, False)):
                with pytest.raises(APIError) as refused:
                    await fresh.identify({})
                assert refused.value.status == 401 and "API keys" in refused.value.message
                assert not await fresh.serves_anonymously()
            await client.flushdb()  # Redis restarted empty, or failed over to an empty replica
            with pytest.raises(APIError) as refused:
                await tenancy.identify({"authorization": "Bearer sk-anything"})
            assert refused.value.status == 401  # this process has seen keys: closed for its life
            assert not await tenancy.serves_anonymously()
            assert (
                await Tenancy(client, False).identify({})
            ).tenant == ANONYMOUS_TENANT  # a new one: nothing to know
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_gateway_that_may_not_run_open_refuses_keyless_requests_without_asking_redis():
    async def run() -> None:
        client = aioredis.from_url("redis://127.0.0.1:1/0")  # unreachable: a Redis call would be a 503
        try:
            tenancy = Tenancy(client, require_api_key=False, anonymous_allowed=False)
            with pytest.raises(APIError) as refused:
                await tenancy.identify({})
            assert refused.value.status == 401
            assert not await tenancy.serves_anonymously()
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_429_stays_a_429_while_redis_refuses_writes(db_url, caplog):
    """The refusal's count is best-effort: a Redis that takes no writes (no replica to confirm them) must not
    turn the caller's 429 into a 500."""
    _, record = KeyStore(redis.Redis.from_url(db_url)).create("t-readonly", rpm=1)
    admin = redis.Redis.from_url(db_url)

    async def run() -> None:
        client = aioredis.from_url(db_url)
        try:
            tenancy = Tenancy(client, False)
            caller = Caller.of(record)
            await tenancy.admit(caller, "first", 0)  # the minute's one request
            admin.config_set("min-replicas-to-write", 1)  # no replica: every write is refused
            try:
                with pytest.raises(APIError) as refused:
                    await tenancy.admit(caller, "second", 0)
            finally:
                admin.config_set("min-replicas-to-write", 0)
            assert refused.value.status == 429 and refused.value.headers["retry-after"]
        finally:
            await client.aclose()

    asyncio.run(run())
    assert "refused request not counted" in caplog.text


def test_a_key_may_use_the_base_model_and_its_own_adapters_that_are_served():
    from gateway.tenants.api_keys import KeyRecord

    owner = KeyRecord("0" * 16, "acme", "salt", None, None, None, None, 0.0, adapters=("sql", "not-served"))
    assert Caller.of(owner).models(["tiny"], ["chat", "sql"]) == ["tiny", "sql"]
    plain = KeyRecord("1" * 16, "acme", "salt", None, None, None, None, 0.0)
    assert Caller.of(plain).models(["tiny"], ["chat", "sql"]) == ["tiny"]  # no adapters field: the base only
    no_base = KeyRecord("2" * 16, "acme", "salt", None, None, None, ("other",), 0.0, adapters=("sql",))
    assert Caller.of(no_base).models(["tiny"], ["sql"]) == ["sql"]  # --models limits the base models alone
    # an open gateway has no tenants to own adapters: its anonymous caller may use every one served
    assert Caller.of(None).models(["tiny"], ["chat", "sql"]) == ["tiny", "chat", "sql"]
