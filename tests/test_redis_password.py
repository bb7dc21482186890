"""Durable, password-protected Redis: every kvserve command takes the password in its Redis URL, says in one line
when it is missing or wrong, never prints it, and API keys survive a restart from the append-only file."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest
import redis

from kvserve.redis_server import start_redis_server
from shared.redis_url import masked
from tests.processes import GatewayProcess, eventually, free_port, run_kvserve

PASSWORD = "s3cr3t-Pa55word"


def test_masked_hides_the_password_and_keeps_everything_else():
    assert masked("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert masked("rediss://user:p%40ss@h.example:6380/2") == "rediss://user:***@h.example:6380/2"
    assert masked("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def server():
    """A real valkey requiring PASSWORD, with an append-only file, stopped by its own PID."""
    server = start_redis_server(persistent=True, password=PASSWORD)
    yield server
    server.stop()


def without_password(url: str) -> str:
    return url.replace(f":{PASSWORD}@", "")


def wrong_password(url: str) -> str:
    return url.replace(PASSWORD, "not-the-password")


def kvserve(*argv: str, url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`kvserve ...` as a child process, its Redis URL (if any) in KVSERVE_REDIS_URL as a deployment gives it."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_REDIS_URL"}
    if url is not None:
        env["KVSERVE_REDIS_URL"] = url
    return run_kvserve(*argv, env=env, timeout=timeout)


def test_the_server_refuses_clients_without_the_password(server):
    assert PASSWORD not in " ".join(server.command)  # in a 0600 config file, not visible to `ps`
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(without_password(server.url)).ping()
    assert redis.Redis.from_url(server.url).ping()


def executor_argv(model: str) -> list[str]:
    port = free_port()
    return ["executor", "--executor-id", "e0", "--bind", f"tcp://127.0.0.1:{port}", "--model", model]


@pytest.mark.parametrize(
    ("which", "make_url", "says"),
    [
        ("missing", without_password, "requires a password and the URL has none"),
        ("wrong", wrong_password, "refused the URL's password"),
    ],
)
def test_a_missing_or_wrong_password_is_one_line_at_start_up(server, default_model, which, make_url, says):
    url = make_url(server.url)
    runs = {
        "executor": kvserve(*executor_argv(default_model), url=url),
        "gateway": kvserve("gateway", "--model", default_model, "--port", str(free_port()), url=url),
        "keys": kvserve("keys", "list", url=url),
    }
    for command, done in runs.items():
        assert done.returncode in (1, 2), (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, (command, done.stderr)
        assert lines[0].startswith(f"kvserve {command}") and says in lines[0], (command, lines[0])
        assert masked(without_password(url)).split("//")[1] in lines[0]  # names the server
        assert "not-the-password" not in done.stderr + done.stdout


def aof_holds(server, text: str) -> bool:
    """Whether the append-only file has this on disk (fsync'd every second), so a kill -9 keeps it."""
    folder = server.data_dir
    return any(text.encode() in path.read_bytes() for path in folder.rglob("*.aof"))


def test_keys_survive_a_restart_from_the_append_only_file_and_authenticate_at_a_gateway(
    server, default_model, tmp_path
):
    created = kvserve("keys", "create", "--tenant", "durable", url=server.url)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    key_id = key.split("_")[1]
    assert eventually(lambda: aof_holds(server, key_id), timeout=5)

    server.kill()  # as a crash or a rescheduled pod: nothing but the append-only file is left
    server.restart()

    listed = kvserve("keys", "list", url=server.url)
    assert listed.returncode == 0 and key_id in listed.stdout, listed.stderr
    gateway = GatewayProcess(default_model, server.url, tmp_path / "gateway.log", "--require-api-key")
    try:

        def models(authorization: str) -> int | None:
            try:
                headers = {"authorization": authorization}
                return httpx.get(f"{gateway.base}/v1/models", headers=headers, timeout=5).status_code
            except httpx.HTTPError:
                return None

        deadline = time.monotonic() + 60
        while models(f"Bearer {key}") is None and time.monotonic() < deadline:
            assert gateway.process.poll() is None, gateway.log_path.read_text()
            time.sleep(0.1)
        assert models(f"Bearer {key}") == 200
        assert models(f"Bearer kvs_{key_id}_{'0' * 32}") == 401
    finally:
        gateway.stop()
    assert PASSWORD not in gateway.log_path.read_text()


def test_a_restarted_server_is_ready_only_once_its_data_has_loaded(server):
    """A large append-only file takes a while to load, and the server answers -LOADING meanwhile: restart()
    returns only when an authenticated PING gets PONG, so the first command after it never fails."""
    client = redis.Redis.from_url(server.url)
    pipe = client.pipeline(transaction=False)
    for i in range(300_000):
        pipe.set(f"load:{i}", "x" * 32)
    pipe.execute()
    client.close()
    server.process.kill()
    server.process.wait()
    server.restart()
    again = redis.Redis.from_url(server.url)
    assert again.get("load:299999") == b"x" * 32  # no BusyLoadingError
    again.delete(*[f"load:{i}" for i in range(0, 300_000)])
    again.close()
