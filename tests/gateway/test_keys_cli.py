import asyncio
import subprocess
import sys

import pytest
import redis
import redis.asyncio as aioredis

from kvserve.cli import main
from shared import redis_keys
from shared.api_keys import authenticate


@pytest.fixture
def db_url(redis_url, monkeypatch):
    """A database of this file's own, so `list` and `usage` without --tenant see only this test's keys."""
    monkeypatch.delenv("KVSERVE_REDIS_URL", raising=False)
    url = redis_url.rsplit("/", 1)[0] + "/10"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


def _kvserve(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of `kvserve ...` run in this process."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def _authenticates(url: str, key: str) -> bool:
    async def run():
        async with aioredis.from_url(url) as client:
            return await authenticate(client, key) is not None

    return asyncio.run(run())


def test_create_list_revoke(db_url, capsys, monkeypatch):
    status, out, err = _kvserve(
        capsys,
        "keys",
        "create",
        "--tenant",
        "acme",
        "--rpm",
        "60",
        "--models",
        "m1,m2",
        "--redis-url",
        db_url,
    )
    assert status == 0 and len(out) == 1 and "only" in err and "once" in err
    key = out[0]
    assert key.startswith("kvs_") and _authenticates(db_url, key)
    key_id = key.split("_")[1]
    assert key_id in err and key not in err

    monkeypatch.setenv("KVSERVE_REDIS_URL", db_url)  # the default for --redis-url
    status, out, _ = _kvserve(capsys, "keys", "create", "--tenant", "globex", "--max-concurrency", "4")
    other_key = out[0]
    other_id = other_key.split("_")[1]

    status, out, _ = _kvserve(capsys, "keys", "list")
    assert status == 0 and len(out) == 3
    assert out[0].split()[:6] == ["KEY", "ID", "TENANT", "RPM", "TPM", "MAX"]
    assert out[1].split()[:6] == [other_id, "globex", "-", "-", "4", "all"]  # newest first
    assert out[2].split()[:6] == [key_id, "acme", "60", "-", "-", "m1,m2"]
    assert out[1].split()[-1] == out[2].split()[-1] == "active"
    assert not any(key in line for line in out)

    status, out, _ = _kvserve(capsys, "keys", "revoke", key)
    assert status == 0 and out == [f"revoked {key_id} (tenant acme)"]
    assert not _authenticates(db_url, key) and _authenticates(db_url, other_key)
    status, out, _ = _kvserve(capsys, "keys", "list", "--tenant", "acme")
    assert len(out) == 2 and out[1].split()[0] == key_id and out[1].split()[-1] == "revoked"

    status, _, err = _kvserve(capsys, "keys", "revoke", "0123456789abcdef")
    assert status == 1 and "no API key with id 0123456789abcdef" in err
    status, _, err = _kvserve(capsys, "keys", "revoke", "kvs_nonsense")
    assert status == 1 and "not a key id" in err and "nonsense" not in err


def test_bad_input_and_missing_redis_url(db_url, capsys):
    status, out, err = _kvserve(capsys, "keys", "create", "--tenant", "a:b", "--redis-url", db_url)
    assert status == 2 and out == [] and "tenant" in err
    status, out, err = _kvserve(
        capsys, "keys", "create", "--tenant", "t", "--tpm", "0", "--redis-url", db_url
    )
    assert status == 2 and out == [] and "tpm" in err
    for argv in (["create", "--tenant", "t"], ["list"], ["revoke", "0123456789abcdef"], ["usage"]):
        status, out, err = _kvserve(capsys, "keys", *argv)
        assert status == 2 and out == [] and "--redis-url" in err and "KVSERVE_REDIS_URL" in err
    status, _, err = _kvserve(capsys, "keys", "list", "--redis-url", "redis://127.0.0.1:1/0")
    assert status == 1 and "Redis at redis://127.0.0.1:1/0" in err


def test_usage(db_url, capsys):
    client = redis.Redis.from_url(db_url)
    usage = {"requests": 3, "prompt_tokens": 40, "completion_tokens": 12, "cached_tokens": 16}
    client.hset(redis_keys.tenant_usage_key("acme"), mapping=usage)
    client.hset(redis_keys.tenant_usage_key("globex"), mapping={"requests": 1, "rejected": 2})
    status, out, _ = _kvserve(capsys, "keys", "usage", "--redis-url", db_url)
    assert status == 0
    assert [line.split() for line in out] == [
        ["TENANT", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS", "CACHED_TOKENS", "REJECTED"],
        ["acme", "3", "40", "12", "16", "0"],
        ["globex", "1", "0", "0", "0", "2"],
    ]
    status, out, _ = _kvserve(capsys, "keys", "usage", "--tenant", "globex", "--redis-url", db_url)
    assert [line.split()[0] for line in out] == ["TENANT", "globex"]


def test_the_key_is_stdouts_first_line_alone(db_url):
    """`KEY=$(kvserve keys create --tenant t | head -1)` must capture the key."""
    command = [sys.executable, "-m", "kvserve.cli", "keys", "create", "--tenant", "t", "--redis-url", db_url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert _authenticates(db_url, done.stdout.splitlines()[0])
