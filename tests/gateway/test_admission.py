"""What a request is told before it is routed (gateway/serving/admission.py): the in-process gateway over a real
Redis, with one executor that exists only as its registration (nothing here reaches it)."""

from __future__ import annotations

import time

import pytest
import redis
from starlette.testclient import TestClient

from gateway.app import GatewayConfig, build_app
from gateway.tenants.api_keys import KeyStore
from shared import redis_keys

DB = 13  # a database of its own: the gateway sees every executor registered in it, and keys close it
EXECUTOR = "registered-only"
BLOCK_SIZE = 16


@pytest.fixture
def db(redis_url):
    url = redis_url.rsplit("/", 1)[0] + f"/{DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    info = {"address": "tcp://127.0.0.1:1", "model": "tiny", "block_size": BLOCK_SIZE, "max_model_len": 2048}
    client.hset(redis_keys.executor_key(EXECUTOR), mapping=info)
    client.hset(redis_keys.load_key(EXECUTOR), mapping={"queue_full": 1})  # no room: requests would wait
    client.sadd(redis_keys.EXECUTORS, EXECUTOR)
    yield url, client
    client.flushdb()


def _bytes_redis_received(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_input_bytes"])


def test_a_prompt_past_every_context_is_a_400_without_a_routing_read(db, tokenizer):
    """10,000 blocks of token ids: the 400 comes from the executors' registrations alone; their routing read would
    have sent Redis 640 kB of block hashes (and once came back as a 503)."""
    url, client = db
    config = GatewayConfig(url, "tiny", tokenizer, queue_timeout=30)
    with TestClient(build_app(config)) as gateway:
        before = _bytes_redis_received(client)
        started = time.monotonic()
        response = gateway.post(
            "/v1/completions", json={"model": "tiny", "prompt": [1] * (10_000 * BLOCK_SIZE), "max_tokens": 1}
        )
        elapsed = time.monotonic() - started
        sent = _bytes_redis_received(client) - before
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in response.json()["error"]["message"]
    assert sent < 20_000, sent
    assert elapsed < 10  # not held in the backlog behind the full executor


def test_a_caller_past_its_limit_hears_429_on_arrival_not_after_the_backlog_wait(db, tokenizer):
    url, client = db
    key, record = KeyStore(client).create("arrival", rpm=1)
    seconds, microseconds = client.time()
    spent = {"level": 0, "at": seconds + microseconds / 1e6}  # its one request of this minute is taken
    client.hset(redis_keys.limit_key(record.key_id, "rpm"), mapping=spent)
    config = GatewayConfig(url, "tiny", tokenizer, queue_timeout=5)
    with TestClient(build_app(config)) as gateway:
        started = time.monotonic()
        response = gateway.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
        )
        elapsed = time.monotonic() - started
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert elapsed < 4  # every executor is full: after the backlog's wait it would have been a 503


def test_an_admitted_request_that_reaches_no_executor_gives_its_admission_back(db, tokenizer):
    url, client = db
    key, record = KeyStore(client).create("given-back", tpm=1000, max_concurrency=1)
    config = GatewayConfig(url, "tiny", tokenizer, queue_timeout=0.5)
    with TestClient(build_app(config)) as gateway:
        response = gateway.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 100},
            headers={"authorization": f"Bearer {key}"},
        )
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
    assert client.zcard(redis_keys.limit_key(record.key_id, "concurrency")) == 0  # its slot is free
    tokens = client.hget(redis_keys.limit_key(record.key_id, "tpm"), "level")
    assert float(tokens) == pytest.approx(1000, abs=1)  # the reservation came back
    assert not client.hexists(redis_keys.tenant_usage_key("given-back"), "requests")  # it never ran
