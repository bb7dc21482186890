"""`kvserve up`'s persistent store: keys made before the first `kvserve up`, beside a running one or between
runs (no --redis-url) open its gateway and survive its restart; one server at a time on a data directory, and
nothing a SIGKILLed holder leaves behind stops the next command."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.kvserve.up_process import Up, kvserve_env
from tests.processes import REPO, eventually, run_kvserve


def kvserve(home: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`kvserve ...` with this data directory (KVSERVE_HOME) and no Redis URL in its environment."""
    return run_kvserve(*argv, env={**kvserve_env(), "KVSERVE_HOME": str(home)}, timeout=timeout)


def create_key(home: Path, tenant: str) -> str:
    done = kvserve(home, "keys", "create", "--tenant", tenant)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def models_status(up: Up, key: str | None) -> int:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.get(f"{up.base}/v1/models", headers=headers, timeout=10).status_code


def requests_of(home: Path, tenant: str) -> int:
    done = kvserve(home, "keys", "usage", "--tenant", tenant)
    assert done.returncode == 0, done.stderr
    header, row = (line.split() for line in done.stdout.splitlines())
    return int(row[header.index("REQUESTS")])


def lock_is_free(home: Path) -> bool:
    """Whether no process holds the store's lock (one taken here is given back at once)."""
    fd = os.open(home / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


# -- one store and one stack on it; the restart test comes last --------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store") / "kvserve"  # made by the first command, as a user's would be


@pytest.fixture(scope="module")
def keys(home) -> dict[str, str]:
    """tenant -> key, the first made before any `kvserve up` has run on the folder."""
    return {"before": create_key(home, "before")}


@pytest.fixture(scope="module")
def stack(tiny_models, home, keys, tmp_path_factory):
    """`kvserve up --require-api-key` on the store (it refuses to start without a key), logging to a file in
    the default format."""
    logs = tmp_path_factory.mktemp("store-up")
    up = Up(
        tiny_models["llama"],
        logs / "up.log",
        "--require-api-key",
        executors=1,
        data_dir=home,
        log_format=None,
    )
    try:
        up.wait_serving(1)
        yield up
    finally:
        up.stop()


@pytest.mark.slow
def test_a_key_made_before_the_first_up_opens_its_gateway_and_the_store_is_private(stack, home, keys):
    assert models_status(stack, keys["before"]) == 200
    assert models_status(stack, None) == 401
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "redis.password").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "redis.url").stat().st_mode) == 0o600
    password = (home / "redis.password").read_text().strip()
    assert f":{password}@127.0.0.1:" in stack.redis_url()  # the password made by `keys create`, kept


@pytest.mark.slow
def test_a_key_made_beside_the_running_stack_is_valid_at_once(stack, home, keys):
    keys["beside"] = create_key(home, "beside")
    assert models_status(stack, keys["beside"]) == 200
    listed = kvserve(home, "keys", "list")
    assert listed.returncode == 0 and {"before", "beside"} <= {
        line.split()[1] for line in listed.stdout.splitlines()
    }


@pytest.mark.slow
def test_a_second_up_on_the_same_data_directory_is_refused_naming_the_first(stack, home, keys, tiny_models):
    second = kvserve(home, "up", "--model", tiny_models["llama"], "--port", "1", timeout=60)
    assert second.returncode == 1, second.stderr
    message = (
        f"kvserve up: error: another kvserve up (pid {stack.process.pid}) serves from the data directory"
    )
    assert message in second.stderr.strip().splitlines()[-1]
    assert models_status(stack, keys["before"]) == 200  # the first serves on, its data untouched


@pytest.mark.slow
def test_on_a_pipe_up_and_its_executors_log_json_lines(stack):
    lines = [json.loads(line) for line in stack.text().splitlines() if line.strip()]
    assert {"kvserve-up", "kvserve-gateway", "kvserve-executor"} <= {line["service"] for line in lines}


@pytest.mark.slow
def test_keys_and_usage_survive_a_restart_of_up(stack, home, keys, tiny_models, tmp_path):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(
        f"{stack.base}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {keys['before']}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    used = requests_of(home, "before")
    assert used >= 1
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(60) == 0, stack.text()
    assert lock_is_free(home) and not (home / "redis.url").exists()

    again = Up(tiny_models["llama"], tmp_path / "up.log", "--require-api-key", executors=1, data_dir=home)
    try:
        again.wait_serving(1)
        assert models_status(again, keys["before"]) == 200 and models_status(again, keys["beside"]) == 200
        assert models_status(again, None) == 401
        assert requests_of(home, "before") == used
    finally:
        again.stop()


# -- without a stack ------------------------------------------------------------------------------------------

# What `kvserve up` does with the store, without executors or a gateway: claim it, start its server, name it
HOLDER = """
import sys, time
from pathlib import Path
from kvserve.data_dir import open_data_dir
from kvserve.store import claim
held = claim(open_data_dir(Path(sys.argv[1])))
held.publish(held.start_server().url)
print("serving", flush=True)
time.sleep(600)
"""


def test_what_a_sigkilled_holder_leaves_stops_no_later_command(tmp_path):
    home = tmp_path / "kvserve"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(home)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=kvserve_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "serving"
        key_id = create_key(home, "acme").split("_")[1]  # through the holder's server
        aof = home / "redis" / "appendonlydir"
        assert eventually(
            lambda: any(key_id.encode() in f.read_bytes() for f in aof.glob("*.aof")), timeout=5
        )
    finally:
        holder.kill()  # as a `kvserve up` killed with -9: its server dies with it, its files stay
        holder.wait()
    assert (home / "redis.url").exists()
    assert eventually(lambda: lock_is_free(home), timeout=5)  # the server's copy of the lock went with it
    listed = kvserve(home, "keys", "list")
    assert listed.returncode == 0 and key_id in listed.stdout, listed.stderr
    assert not (home / "redis.url").exists()  # the stale name is gone, not followed


def test_keys_commands_at_once_on_a_store_without_a_server_take_turns(tmp_path):
    home = tmp_path / "kvserve"
    env = {**kvserve_env(), "KVSERVE_HOME": str(home)}
    argv = [sys.executable, "-m", "kvserve.cli", "keys", "create", "--tenant"]
    started = [
        subprocess.Popen([*argv, f"t{i}"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(3)
    ]
    for process in started:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
    listed = kvserve(home, "keys", "list")
    assert sorted(line.split()[1] for line in listed.stdout.splitlines()[1:]) == ["t0", "t1", "t2"]
    assert lock_is_free(home)


def test_redis_url_and_data_dir_together_are_refused(tmp_path):
    for command in (["keys", "list"], ["up"]):
        done = kvserve(
            tmp_path, *command, "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path)
        )
        assert done.returncode == 2 and "--data-dir" in done.stderr and "give one" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []  # nothing made
