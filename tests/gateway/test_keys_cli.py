import asyncio
import json
import stat
import subprocess
import sys

import pytest
import redis
import redis.asyncio as aioredis

from gateway.tenants.api_keys import authenticate
from gateway.tenants.key_backup import _key
from kvserve.cli import main
from shared import redis_keys


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
    status, out, _ = _kvserve(
        capsys, "keys", "create", "--tenant", "globex", "--max-concurrency", "4", "--weight", "2.5"
    )
    other_key = out[0]
    other_id = other_key.split("_")[1]

    status, out, _ = _kvserve(capsys, "keys", "list")
    assert status == 0 and len(out) == 3
    assert out[0].split()[:8] == ["KEY", "ID", "TENANT", "RPM", "TPM", "MAX", "CONCURRENCY", "WEIGHT"]
    assert out[1].split()[:7] == [other_id, "globex", "-", "-", "4", "2.5", "all"]  # newest first
    assert out[2].split()[:7] == [key_id, "acme", "60", "-", "-", "1", "m1,m2"]
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


def test_bad_input(db_url, capsys):
    status, out, err = _kvserve(capsys, "keys", "create", "--tenant", "a:b", "--redis-url", db_url)
    assert status == 2 and out == [] and "tenant" in err
    status, out, err = _kvserve(
        capsys, "keys", "create", "--tenant", "t", "--tpm", "0", "--redis-url", db_url
    )
    assert status == 2 and out == [] and "tpm" in err
    for weight in ("0", "-1", "1001", "nan"):
        status, out, err = _kvserve(
            capsys, "keys", "create", "--tenant", "t", "--weight", weight, "--redis-url", db_url
        )
        assert status == 2 and out == [] and "weight" in err
    status, _, err = _kvserve(capsys, "keys", "list", "--redis-url", "redis://127.0.0.1:1/0")
    assert status == 1 and "Redis at redis://127.0.0.1:1/0" in err


def test_usage(db_url, capsys):
    client = redis.Redis.from_url(db_url)
    usage = {
        "requests": 3,
        "prompt_tokens": 40,
        "completion_tokens": 12,
        "cached_tokens": 16,
        "cached_tokens_pool": 4,
        "cached_tokens_disk": 12,
        "computed_prompt_tokens": 24,
        "kv_block_seconds": "12.3456",
    }
    client.hset(redis_keys.tenant_usage_key("acme"), mapping=usage)
    client.hset(redis_keys.tenant_usage_key("globex"), mapping={"requests": 1, "rejected": 2})
    status, out, _ = _kvserve(capsys, "keys", "usage", "--redis-url", db_url)
    assert status == 0
    header = (
        "REQUESTS PROMPT_TOKENS COMPLETION_TOKENS CACHED_TOKENS CACHED_TOKENS_POOL CACHED_TOKENS_HOST "
        "CACHED_TOKENS_DISK CACHED_TOKENS_PEER COMPUTED_PROMPT_TOKENS KV_BLOCK_SECONDS REJECTED"
    )
    assert [line.split() for line in out] == [
        ["TENANT", *header.split()],
        ["acme", "3", "40", "12", "16", "4", "0", "12", "0", "24", "12.346", "0"],
        ["globex", "1", "0", "0", "0", "0", "0", "0", "0", "0", "0.000", "2"],
    ]
    status, out, _ = _kvserve(capsys, "keys", "usage", "--tenant", "globex", "--redis-url", db_url)
    assert [line.split()[0] for line in out] == ["TENANT", "globex"]


def test_the_key_is_stdouts_first_line_alone(db_url):
    """`KEY=$(kvserve keys create --tenant t | head -1)` must capture the key."""
    command = [sys.executable, "-m", "kvserve.cli", "keys", "create", "--tenant", "t", "--redis-url", db_url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert _authenticates(db_url, done.stdout.splitlines()[0])


# -- export and import -------------------------------------------------------------------------------------


@pytest.fixture
def empty_url(monkeypatch):
    """A Redis server of its own, empty: where a backup is restored."""
    from kvserve.redis_server import start_redis_server

    monkeypatch.delenv("KVSERVE_REDIS_URL", raising=False)
    server = start_redis_server()
    yield server.url
    server.stop()


def _create(capsys, url: str, *args: str) -> str:
    status, out, _ = _kvserve(capsys, "keys", "create", *args, "--redis-url", url)
    assert status == 0
    return out[0]


def _records(url: str) -> list[dict]:
    client = redis.Redis.from_url(url, decode_responses=True)
    rows = [client.hgetall(k) for k in sorted(client.scan_iter(match=redis_keys.api_key_key("*")))]
    tenants = {
        k: client.hgetall(k) for k in client.scan_iter(match=redis_keys.tenant_key("*")) if ":usage" not in k
    }
    return [rows, tenants, sorted(client.smembers(redis_keys.API_KEYS))]


def test_export_then_import_into_an_empty_redis_restores_every_tenant_and_key(
    db_url, empty_url, capsys, tmp_path
):
    limited = _create(capsys, db_url, "--tenant", "acme", "--rpm", "60", "--tpm", "9000", "--models", "m1,m2")
    plain = _create(capsys, db_url, "--tenant", "acme")
    other = _create(capsys, db_url, "--tenant", "globex", "--max-concurrency", "2", "--weight", "3")
    revoked = _create(capsys, db_url, "--tenant", "globex")
    assert _kvserve(capsys, "keys", "revoke", revoked, "--redis-url", db_url)[0] == 0
    redis.Redis.from_url(db_url).hset(redis_keys.tenant_usage_key("acme"), "requests", 5)  # not a tenant

    backup = tmp_path / "keys.jsonl"
    status, out, err = _kvserve(capsys, "keys", "export", "--out", str(backup), "--redis-url", db_url)
    assert status == 0 and out == [] and "6" in err  # two tenants, four keys
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    text = backup.read_text()
    for key in (limited, plain, other, revoked):
        assert key.split("_", 2)[2] not in text  # never a plaintext secret (token_urlsafe: it may hold "_")
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines[0] == {"type": "header", "format": "kvserve-keys", "version": 1}
    assert sorted(line["tenant"] for line in lines if line["type"] == "tenant") == ["acme", "globex"]
    weights = {line["key_id"]: line["weight"] for line in lines if line["type"] == "key"}
    assert weights[other.split("_")[1]] == 3.0 and weights[plain.split("_")[1]] == 1.0
    # an export made before weights existed still imports, each key at weight 1
    old_line = {k: v for k, v in lines[-1].items() if k != "weight"}
    assert (
        _key(old_line, {t["tenant"]: t["cache_salt"] for t in lines if t["type"] == "tenant"})[0].weight
        == 1.0
    )

    assert not redis.Redis.from_url(empty_url).exists(redis_keys.KEYED_DEPLOYMENT)
    status, out, _ = _kvserve(capsys, "keys", "import", str(backup), "--redis-url", empty_url)
    assert status == 0 and len(out) == 6
    assert _records(empty_url) == _records(db_url)
    # restored keys make a keyed deployment: revoking them all later does not open its gateways
    assert redis.Redis.from_url(empty_url).exists(redis_keys.KEYED_DEPLOYMENT)
    for key in (limited, plain, other):
        assert _authenticates(empty_url, key)
    assert not _authenticates(empty_url, revoked)

    # idempotent: again, nothing to write and nothing changes
    status, out, err = _kvserve(capsys, "keys", "import", str(backup), "--redis-url", empty_url)
    assert status == 0 and out == [] and "6 already there" in err
    assert _records(empty_url) == _records(db_url)

    # and stdout round-trips as well as --out
    status, out, _ = _kvserve(capsys, "keys", "export", "--redis-url", empty_url)
    assert status == 0 and [json.loads(line) for line in out] == lines


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("not json", "line 3"),
        ('["a list"]', "line 3: not a JSON object"),
        ('{"type": "user", "tenant": "x"}', "line 3: type"),
        ('{"type": "tenant", "tenant": "bad name!", "cache_salt": "' + "0" * 64 + '"}', "line 3: tenant"),
        ('{"type": "tenant", "tenant": "t2", "cache_salt": "short"}', "line 3: tenant t2: cache_salt"),
        (
            '{"type": "tenant", "tenant": "t2", "cache_salt": "' + "0" * 64 + '", "extra": 1}',
            "line 3: unknown field(s) extra",
        ),
    ],
)
def test_import_refuses_a_malformed_line_naming_it_and_writes_nothing(
    empty_url, capsys, tmp_path, bad, problem
):
    salt = "ab" * 32
    good = [
        json.dumps({"type": "header", "format": "kvserve-keys", "version": 1}),
        json.dumps({"type": "tenant", "tenant": "t1", "cache_salt": salt}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([*good, bad]) + "\n")
    status, out, err = _kvserve(capsys, "keys", "import", str(path), "--redis-url", empty_url)
    assert status == 2 and problem in err and str(path) in err, err
    assert redis.Redis.from_url(empty_url).dbsize() == 0


def test_import_refuses_a_key_line_that_would_not_authenticate_or_has_no_tenant(empty_url, capsys, tmp_path):
    header = json.dumps({"type": "header", "format": "kvserve-keys", "version": 1})
    key = {
        "type": "key",
        "key_id": "0123456789abcdef",
        "tenant": "t1",
        "secret_sha256": "cd" * 32,
        "rpm": None,
        "tpm": None,
        "max_concurrency": None,
        "models": None,
        "created_at": 1.0,
        "revoked_at": None,
    }
    for line, problem in [
        (key, "line 2: key 0123456789abcdef: tenant t1 has no tenant line"),
        ({**key, "secret_sha256": "kvs_plaintext"}, "secret_sha256"),
        ({**key, "rpm": 0}, "rpm"),
    ]:
        tenant = (
            []
            if "tenant t1 has no" in problem
            else [json.dumps({"type": "tenant", "tenant": "t1", "cache_salt": "ab" * 32})]
        )
        path = tmp_path / "key.jsonl"
        path.write_text("\n".join([header, *tenant, json.dumps(line)]))
        status, _, err = _kvserve(capsys, "keys", "import", str(path), "--redis-url", empty_url)
        assert status == 2 and problem in err, err
    assert redis.Redis.from_url(empty_url).dbsize() == 0


def test_import_over_records_held_otherwise_needs_replace(db_url, empty_url, capsys, tmp_path):
    exported = _create(capsys, db_url, "--tenant", "acme")
    backup = tmp_path / "keys.jsonl"
    assert _kvserve(capsys, "keys", "export", "--out", str(backup), "--redis-url", db_url)[0] == 0
    local = _create(capsys, empty_url, "--tenant", "acme")  # the same tenant, another salt, another key
    status, _, err = _kvserve(capsys, "keys", "import", str(backup), "--redis-url", empty_url)
    assert status == 2 and "tenant acme" in err and "--replace" in err
    assert not _authenticates(empty_url, exported)  # nothing was written

    status, out, _ = _kvserve(capsys, "keys", "import", str(backup), "--replace", "--redis-url", empty_url)
    assert status == 0 and _authenticates(empty_url, exported) and _authenticates(empty_url, local)
    client = redis.Redis.from_url(empty_url, decode_responses=True)
    salt = client.hget(redis_keys.tenant_key("acme"), "cache_salt")
    salts = {client.hget(k, "cache_salt") for k in client.scan_iter(match=redis_keys.api_key_key("*"))}
    assert salts == {salt}  # the key the file did not name follows its tenant's restored salt


def test_export_over_a_readable_file_leaves_it_the_owners_only(db_url, capsys, tmp_path):
    _create(capsys, db_url, "--tenant", "acme")
    backup = tmp_path / "keys.jsonl"
    backup.write_text("an older export\n")
    backup.chmod(0o644)  # world-readable, as a file made by hand or by a copy may be
    status, _, _ = _kvserve(capsys, "keys", "export", "--out", str(backup), "--redis-url", db_url)
    assert status == 0
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    assert json.loads(backup.read_text().splitlines()[0])["format"] == "kvserve-keys"
    assert [p.name for p in tmp_path.iterdir()] == ["keys.jsonl"]  # no staging file left behind


def test_export_refuses_a_symbolic_link(db_url, capsys, tmp_path):
    _create(capsys, db_url, "--tenant", "acme")
    target = tmp_path / "elsewhere.txt"
    target.write_text("not ours to overwrite\n")
    target.chmod(0o644)
    link = tmp_path / "keys.jsonl"
    link.symlink_to(target)
    status, _, err = _kvserve(capsys, "keys", "export", "--out", str(link), "--redis-url", db_url)
    assert status == 2 and "symbolic link" in err and "--out" in err
    assert link.is_symlink() and target.read_text() == "not ours to overwrite\n"


def test_keys_own_adapters_and_operators_set_at_create_changed_by_update_and_kept_by_export(
    db_url, empty_url, capsys, tmp_path
):
    key = _create(capsys, db_url, "--tenant", "acme", "--adapters", "sql,chat:v2", "--operator")
    plain = _create(capsys, db_url, "--tenant", "acme")
    status, out, _ = _kvserve(capsys, "keys", "list", "--redis-url", db_url)
    rows = {line.split()[0]: line.split() for line in out[1:]}
    assert status == 0 and out[0].split()[9:11] == ["ADAPTERS", "OPERATOR"]
    assert rows[key.split("_")[1]][7:9] == ["sql,chat:v2", "yes"]
    assert rows[plain.split("_")[1]][7:9] == ["-", "no"]  # no field: the base model only

    status, out, _ = _kvserve(
        capsys, "keys", "update", plain.split("_")[1], "--adapters", "sql", "--redis-url", db_url
    )
    assert status == 0 and out[1].split()[7:9] == ["sql", "no"]
    status, out, _ = _kvserve(
        capsys, "keys", "update", key, "--adapters", "", "--no-operator", "--redis-url", db_url
    )
    assert status == 0 and out[1].split()[7:9] == ["-", "no"]
    assert _authenticates(db_url, key) and _authenticates(db_url, plain)  # its secret and tenant untouched

    backup = tmp_path / "keys.jsonl"
    assert _kvserve(capsys, "keys", "export", "--out", str(backup), "--redis-url", db_url)[0] == 0
    assert _kvserve(capsys, "keys", "import", str(backup), "--redis-url", empty_url)[0] == 0
    assert _records(empty_url) == _records(db_url)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--adapters", "sql,bad name"], "adapters: 'bad name' must be 1-128 letters"),
        (["--adapters=-leading"], "adapters: '-leading'"),
        (["--adapters", "x" * 129], "adapters:"),
        ([], "nothing to change"),
    ],
)
def test_update_refuses_bad_adapter_names_naming_the_field(db_url, capsys, argv, problem):
    key_id = _create(capsys, db_url, "--tenant", "acme").split("_")[1]
    status, out, err = _kvserve(capsys, "keys", "update", key_id, *argv, "--redis-url", db_url)
    assert status == 2 and out == [] and problem in err
    status, _, err = _kvserve(capsys, "keys", "update", "0" * 16, "--adapters", "a", "--redis-url", db_url)
    assert status == 1 and "no API key with id" in err


def test_usage_shows_each_adapters_requests_and_tokens_apart(db_url, capsys):
    counters = {
        "requests": 3,
        "prompt_tokens": 40,
        "requests:adapter:sql": 2,
        "prompt_tokens:adapter:sql": 30,
    }
    redis.Redis.from_url(db_url).hset(redis_keys.tenant_usage_key("acme"), mapping=counters)
    status, out, _ = _kvserve(capsys, "keys", "usage", "--redis-url", db_url)
    assert status == 0 and out[1].split()[:3] == ["acme", "3", "40"]
    assert "ADAPTER" not in out[0] and len(out[0].split()) == 12  # the adapters' counters are not columns
    assert [line.split() for line in out[3:]] == [
        ["TENANT", "ADAPTER", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS"],
        ["acme", "sql", "2", "30", "0"],
    ]
