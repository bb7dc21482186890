import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from gateway.tenants.api_keys import KeyStore, authenticate, deployment_keyed, keys_configured, parse_models
from shared import redis_keys as keys


@pytest.fixture
def db_url(redis_url):
    """A database of this file's own: keys_configured and an unfiltered list() see every key in it."""
    url = redis_url.rsplit("/", 1)[0] + "/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


def _authenticate(url: str, *presented: str) -> list:
    async def run():
        async with aioredis.from_url(url) as client:  # bytes replies, as the gateway's client has them
            return [await authenticate(client, key) for key in presented]

    return asyncio.run(run())


def _configured(url: str) -> bool:
    async def run():
        async with aioredis.from_url(url) as client:
            return await keys_configured(client)

    return asyncio.run(run())


def _keyed(url: str) -> bool:
    async def run():
        async with aioredis.from_url(url) as client:
            return await deployment_keyed(client)

    return asyncio.run(run())


def test_key_lifecycle(db_url):
    client = redis.Redis.from_url(db_url, decode_responses=True)
    store = KeyStore(client)
    assert not _configured(db_url) and not _keyed(db_url)

    key, record = store.create("acme", rpm=10, tpm=1000, max_concurrency=2, models=["m1", "m2"])
    second_key, second = store.create("acme")
    other_key, other = store.create("globex")
    assert _configured(db_url) and _keyed(db_url)
    assert key.startswith(f"kvs_{record.key_id}_") and len(record.key_id) == 16
    assert (record.tenant, record.rpm, record.tpm, record.max_concurrency) == ("acme", 10, 1000, 2)
    assert record.models == ("m1", "m2") and record.revoked_at is None
    assert (second.rpm, second.tpm, second.max_concurrency, second.models) == (None, None, None, None)
    assert record.cache_salt == second.cache_salt != other.cache_salt
    assert len(record.cache_salt) == 64

    assert _authenticate(db_url, key, second_key, other_key) == [record, second, other]
    secret = key.removeprefix(f"kvs_{record.key_id}_")
    wrong_secret = f"kvs_{record.key_id}_{'A' * len(secret)}"
    unknown_id = f"kvs_{'0' * 16}_{secret}"
    malformed = ["", "kvs_", key + " ", key.upper(), f"Bearer {key}", record.key_id, f"kvs_{record.key_id}"]
    assert _authenticate(db_url, wrong_secret, unknown_id, *malformed) == [None] * (2 + len(malformed))

    assert client.hget(keys.api_key_key(record.key_id), "secret_sha256") != secret
    for name in client.scan_iter():  # no plaintext secret anywhere in Redis
        read = {"hash": client.hvals, "set": client.smembers, "string": lambda n: [client.get(n)]}
        values = read[client.type(name)](name)
        assert values and not any(secret in value for value in values)

    revoked = store.revoke(key)  # the full key
    assert revoked.key_id == record.key_id and revoked.revoked_at is not None
    assert store.revoke(second.key_id).revoked_at is not None  # the key id
    assert store.revoke(second.key_id).revoked_at == store.revoke(second.key_id).revoked_at  # kept once
    assert store.revoke("0123456789abcdef") is None and store.revoke("nonsense") is None
    assert _authenticate(db_url, key, second_key, other_key) == [None, None, other]
    assert _configured(db_url)
    store.revoke(other.key_id)
    assert not _configured(db_url)
    assert _keyed(db_url)  # no active key, but the deployment had keys: it does not become open

    listed = store.list()
    assert [r.key_id for r in listed] == [other.key_id, second.key_id, record.key_id]  # newest first
    assert all(r.revoked_at is not None for r in listed)
    assert [r.key_id for r in store.list("acme")] == [second.key_id, record.key_id]
    assert store.list("nobody") == []


def test_a_deployment_keyed_before_the_marker_stays_keyed_through_revocation(db_url):
    client = redis.Redis.from_url(db_url, decode_responses=True)
    store = KeyStore(client)
    _, record = store.create("acme")
    client.delete(keys.KEYED_DEPLOYMENT)  # as a key made by an older kvserve left it
    assert _keyed(db_url)  # an active key is enough
    store.revoke(record.key_id)
    assert _keyed(db_url) and client.exists(keys.KEYED_DEPLOYMENT)


def test_inputs_are_checked_with_the_field_named(db_url):
    store = KeyStore(redis.Redis.from_url(db_url))
    for tenant in ("", "a:b", "a b", "x" * 65, "t*"):
        with pytest.raises(ValueError, match="tenant"):
            store.create(tenant)
    for field in ("rpm", "tpm", "max_concurrency"):
        for bad in (0, -1, 1.5, True, "10"):
            with pytest.raises(ValueError, match=field):
                store.create("acme", **{field: bad})
    for models in ([], ["a", ""], ["a,b"]):
        with pytest.raises(ValueError, match="models"):
            store.create("acme", models=models)
    assert store.list() == []  # nothing half-created
    assert parse_models("a, b") == ("a", "b") and parse_models(None) is None and parse_models("") is None
    with pytest.raises(ValueError, match="models"):
        parse_models("a,,b")


def test_usage_counters_per_tenant(db_url):
    client = redis.Redis.from_url(db_url)
    store = KeyStore(client)
    # as the gateway's release script counts them
    client.hincrby(keys.tenant_usage_key("acme"), "requests", 1)
    client.hincrby(keys.tenant_usage_key("acme"), "prompt_tokens", 10)
    client.hincrby(keys.tenant_usage_key("acme"), "requests", 1)
    client.hincrby(keys.tenant_usage_key("acme"), "prompt_tokens", 5)
    client.hincrby(keys.tenant_usage_key("acme"), "completion_tokens", 7)
    client.hincrby(keys.tenant_usage_key("globex"), "rejected", 1)
    client.hincrbyfloat(keys.tenant_usage_key("acme"), "kv_block_seconds", 2.0)  # Redis keeps it as "2"
    client.hincrbyfloat(keys.tenant_usage_key("acme"), "kv_block_seconds", 1.0)
    expected = {
        "acme": {"requests": 2, "prompt_tokens": 15, "completion_tokens": 7, "kv_block_seconds": 3.0},
        "globex": {"rejected": 1},
    }
    assert isinstance(store.usage("acme")["acme"]["kv_block_seconds"], float)
    assert store.usage() == expected
    assert store.usage("globex") == {"globex": {"rejected": 1}}
    assert store.usage("nobody") == {"nobody": {}}
