"""`kvserve up`: Redis, executors and gateway from one command; children that die come back, SIGTERM drains,
and nothing is left behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateway.server.exit_deadline import EXIT_MARGIN_S
from kvserve.data_dir import DataDir
from kvserve.store import reach
from kvserve.supervisor import RESTART_LIMIT
from shared import redis_keys
from tests.gateway.answers import json_events
from tests.kvserve.up_process import Up, alive, children, command_line, environment, kvserve_env
from tests.processes import eventually, raw_generate, run_kvserve

# in up's environment, and none of its children's business
PLANTED = {"UNRELATED_TOKEN": "planted-secret"}


def reaped(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


# -- one stack for the tests below; the drain test (Ctrl-C) ends it, so it comes last ---------------------------


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("up") / "up.log"
    up = Up(tiny_models["llama"], log, "--shutdown-grace-period", "60", env=PLANTED)
    try:
        up.wait_serving(2)
        yield up
    finally:
        up.stop()


@pytest.mark.slow
def test_up_serves_with_redis_and_two_executors_that_answer_only_holders_of_the_runs_keys(stack):
    assert len(stack.children()) == 3  # Redis and two executors
    response = stack.complete()
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    # its executors run with a key pair made for this run, and a client without it gets nothing
    keys = stack.curve_keys()
    assert sorted(p.name for p in keys.iterdir()) == [
        "executor.key",
        "executor.key_secret",
        "gateway.key",
        "gateway.key_secret",
    ]
    address = redis.Redis.from_url(stack.redis_url()).hget(redis_keys.executor_key("executor-0"), "address")
    assert raw_generate(address.decode(), wait_s=3) is None


class LightLoad:
    """One small completion after another from a thread, until stopped: what each got, or the error."""

    def __init__(self, up: Up) -> None:
        self.up = up
        self.results: list[int | str] = []
        self.running = True
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            try:
                self.results.append(self.up.complete().status_code)
            except httpx.HTTPError as error:
                self.results.append(repr(error))
            time.sleep(0.05)

    def stop(self) -> list[int | str]:
        self.running = False
        self.thread.join()
        return self.results


@pytest.mark.slow
def test_executor_killed_under_load_is_logged_restarted_and_serves_again(stack):
    victim = stack.child("--executor-id executor-1")
    address = re.search(r"--bind (\S+)", command_line(victim)).group(1)
    load = LightLoad(stack)
    try:
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        assert eventually(lambda: reaped(victim), timeout=2)  # no zombie
        # its registration goes at once (not when its heartbeat would expire): nothing is routed to it
        assert eventually(lambda: stack.executors() == ["executor-0"], timeout=3), stack.text()
        assert f"executor-1 died (pid {victim}, killed by SIGKILL)" in stack.text()
        stack.wait_serving(2)
    finally:
        results = load.stop()
    successor = stack.child("--executor-id executor-1")
    assert successor not in (None, victim)
    assert f"executor-1 restarted (pid {successor})" in stack.text()
    assert f"--bind {address}" in command_line(successor)  # the same address
    assert all(isinstance(r, int) for r in results), results  # the gateway answered throughout
    served_by = set()
    for _ in range(30):  # ties between two idle executors break at random
        response = stack.complete()
        assert response.status_code == 200, response.text
        served_by.add(response.headers["x-kvserve-executor"])
        if "executor-1" in served_by:
            break
    assert "executor-1" in served_by


@pytest.mark.slow
def test_embedded_redis_needs_its_random_password_which_no_log_or_command_line_shows(stack):
    url = stack.redis_url()
    password = redis.connection.parse_url(url)["password"]
    assert len(password) >= 32
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(f":{password}@", "")).ping()
    assert redis.Redis.from_url(url).ping()
    assert "@127.0.0.1:" in url  # loopback only
    assert password not in stack.text()
    for pid in stack.children():
        assert password not in command_line(pid), command_line(pid)


@pytest.mark.slow
def test_killed_redis_comes_back_on_its_port_with_its_data(stack):
    url = stack.redis_url()
    client = redis.Redis.from_url(url)
    client.set("test:survives", "yes")  # as an API key would: written just before the kill
    victim = stack.child("valkey-server")
    os.kill(victim, signal.SIGKILL)
    assert eventually(lambda: stack.child("valkey-server") not in (None, victim), timeout=10), stack.text()
    assert f"redis died (pid {victim}, killed by SIGKILL)" in stack.text()
    assert reaped(victim)

    def read_back() -> bytes | None:
        try:
            return redis.Redis.from_url(url).get("test:survives")  # the same URL
        except redis.RedisError:
            return None

    assert eventually(lambda: read_back() == b"yes", timeout=10)
    # the executors' heartbeats register them again and the gateway reconnects
    assert eventually(lambda: stack.executors() == ["executor-0", "executor-1"], timeout=30), stack.text()
    assert eventually(lambda: stack.complete().status_code == 200, timeout=30)


@pytest.mark.slow
def test_each_child_gets_only_the_environment_it_needs(stack):
    """Executors get what an engine reads and the Redis URL; Redis and the grammar compile process (which runs
    clients' grammars) get neither the URL nor its password; nobody gets what up's environment holds for others."""
    url = stack.redis_url()
    password = redis.connection.parse_url(url)["password"]
    constrained = {"model": "tiny", "prompt": "yes or no?", "max_tokens": 4}
    constrained["structured_outputs"] = {"regex": "(yes|no)"}  # starts an executor's grammar compile process
    answer = httpx.post(f"{stack.base}/v1/completions", json=constrained, timeout=120)
    assert answer.status_code == 200, answer.text
    executors = [stack.child(f"--executor-id executor-{i}") for i in range(2)]
    for pid in executors:
        env = environment(pid)
        assert env["KVSERVE_REDIS_URL"] == url and "PATH" in env and "UNRELATED_TOKEN" not in env
    compilers = [
        pid
        for executor in executors
        for pid in descendants(executor)
        if "executor.structured.grammar_worker" in command_line(pid)
    ]
    assert compilers
    for pid in [stack.child("valkey-server"), *compilers]:
        env = environment(pid)
        assert "KVSERVE_REDIS_URL" not in env and "UNRELATED_TOKEN" not in env, command_line(pid)
        assert not any(password in value for value in env.values()), command_line(pid)


@pytest.mark.slow
def test_ctrl_c_drains_requests_in_flight_refuses_new_ones_with_503_and_stops_everything(stack):
    started = stack.children()
    assert len(started) == 3
    keys = stack.curve_keys()
    events: list[dict] = []
    first_event, done = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        try:
            with httpx.stream("POST", f"{stack.base}/v1/completions", json=body, timeout=120) as response:
                for event in json_events(response.iter_lines()):
                    events.append(event)
                    first_event.set()
        finally:
            done.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first_event.wait(60)
    stack.process.send_signal(signal.SIGINT)  # SIGTERM drains the same way (the stuck-executor test below)
    refusals, health = [], []
    # new connections while the stream runs are answered, never refused; the last 100 of its tokens leave
    # room for the moment the stack stops listening, just after the stream ends
    while not done.is_set() and len(events) < 900:
        refusals.append(stack.complete())
        health.append(httpx.get(f"{stack.base}/health", timeout=10))
    streaming.join()
    assert refusals and health
    for response in refusals:
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "draining"
        assert response.json()["error"]["type"] == "server_error"
    assert all(r.status_code == 503 and r.json() == {"status": "draining"} for r in health)
    assert events[-1]["usage"]["completion_tokens"] == 1000  # the request in flight ran to its end
    assert stack.process.wait(30) == 0, stack.text()
    assert eventually(stack.none_left, timeout=10)
    assert "draining (SIGINT)" in stack.text()
    assert not keys.parent.exists()  # the run's private folder, its keys in it, goes with it


# -- nothing left running, and no waiting past the grace period -------------------------------------------


def descendants(pid: int) -> list[int]:
    found = children(pid)
    for child in list(found):
        found += descendants(child)
    return found


@pytest.mark.slow
def test_kill_9_of_up_takes_every_process_it_started_with_it_and_the_next_start_its_secrets(
    tiny_models, tmp_path
):
    up = Up(tiny_models["llama"], tmp_path / "up.log", executors=1)
    try:
        up.wait_serving(1)
        started = descendants(up.process.pid)
        assert up.child("valkey-server") in started and up.child("--executor-id executor-0") in started
        # the run's secrets live in a private folder of its own in the data directory's run/ (no XDG_RUNTIME_DIR
        # here), which names its PID
        run_dir = up.curve_keys().parent
        assert run_dir.parent == up.data_dir / "run" and oct(run_dir.stat().st_mode)[-3:] == "700"
        assert (run_dir / "lock").read_text() == f"{up.process.pid}\n"
        redis.Redis.from_url(up.redis_url()).set("test:kept", "yes")
        time.sleep(1.5)  # appendfsync everysec
        up.process.kill()
        up.process.wait()
        killed = time.monotonic()
        assert eventually(lambda: not any(alive(p) for p in started), timeout=5), [
            command_line(p) for p in started if alive(p)
        ]
        print(f"every child of kvserve up gone {time.monotonic() - killed:.2f} s after its SIGKILL")
        assert (run_dir / "curve" / "executor.key_secret").exists()  # nothing cleaned up after the kill

        # the next start removes it, whatever then stops it (here: keys it is pointed at that do not exist)
        env = {**kvserve_env(), "KVSERVE_HOME": str(up.data_dir)}
        model = ["--model", tiny_models["llama"]]
        stopped = run_kvserve("up", *model, "--curve-keys", str(tmp_path / "none"), env=env, timeout=120)
        assert stopped.returncode == 2 and "--curve-keys" in stopped.stderr, stopped.stderr
        assert not run_dir.exists() and list((up.data_dir / "run").iterdir()) == []
        with reach(DataDir(up.data_dir)) as url:  # the store's data is not a run's: it stays
            assert redis.Redis.from_url(url).get("test:kept") == b"yes"
    finally:
        for pid in descendants(up.process.pid) if up.process.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
        up.stop()


@pytest.mark.slow
def test_sigterm_ends_up_within_the_grace_period_and_seconds_even_with_a_stuck_executor(
    tiny_models, tmp_path
):
    grace = 1
    up = Up(tiny_models["llama"], tmp_path / "up.log", "--shutdown-grace-period", str(grace), executors=1)
    try:
        up.wait_serving(1)
        started = descendants(up.process.pid)
        os.kill(up.child("--executor-id executor-0"), signal.SIGSTOP)  # deaf to SIGTERM
        up.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        up.process.wait(60)
        took = time.monotonic() - signalled
        print(f"kvserve up with a stopped executor ended {took:.1f} s after SIGTERM (grace {grace} s)")
        assert took < grace + EXIT_MARGIN_S + 1, up.text()  # was 10 s and more: SIGKILL 10 s after SIGTERM
        assert eventually(lambda: not any(alive(p) for p in started), timeout=5)
    finally:
        up.stop()


# -- children that do not stay up ----------------------------------------------------------------------------


@pytest.mark.slow
def test_child_that_keeps_dying_ends_up_naming_it(tiny_models, tmp_path):
    up = Up(tiny_models["llama"], tmp_path / "up.log", executors=1)
    try:
        up.wait_serving(1)
        for death in range(1, RESTART_LIMIT + 1):
            victim = up.child("valkey-server")
            os.kill(victim, signal.SIGKILL)
            if death < RESTART_LIMIT:  # back after 0.5, 1, 2, 4 s
                back = lambda v=victim: up.child("valkey-server") not in (None, v)  # noqa: E731
                assert eventually(back, timeout=15), up.text()
        assert up.process.wait(60) == 1
        assert f"kvserve up: error: redis died {RESTART_LIMIT} times within 60 s" in up.text()
        assert eventually(up.none_left, timeout=10)
    finally:
        up.stop()


@pytest.mark.slow
def test_executor_that_exits_at_start_up_ends_up_naming_it(tiny_models, tmp_path):
    # a KV pool too small for one block passes `up`'s checks and fails in the executor's engine
    up = Up(tiny_models["llama"], tmp_path / "up.log", "--kv-cache-memory", "1000", executors=1)
    try:
        assert up.process.wait(180) == 1, up.text()
        assert "kvserve up: error: executor-0 exited while the stack started (exit code 1)" in up.text()
        # the embedded Redis was stopped too, and no longer named (its port, from the log)
        masked = re.search(r"embedded Redis at (\S+)", up.text()).group(1)
        address = redis.connection.parse_url(masked.replace(":***@", "@"))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address["host"], address["port"]), timeout=2).close()
        assert not (up.data_dir / "redis.url").exists()
    finally:
        up.stop()
