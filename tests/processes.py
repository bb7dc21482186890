"""Real processes for tests: free ports, waiting for a condition, executor and gateway subprocesses."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path

import httpx
import redis

from shared import redis_keys as keys

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_kvserve(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """A `kvserve` command run to its end in this checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


PORT_TAKEN = "address already in use"  # ZeroMQ and uvicorn say it so, in either case
PORT_ATTEMPTS = 3  # a free port is free when chosen; another process may take it before the child binds it


class ServiceProcess:
    """A `kvserve` command as a child process logging to a file; stop() ends exactly that process."""

    entry = [sys.executable, "-m", "kvserve.cli"]  # the `kvserve` command
    attempts = 1

    def start(self, args: list[str], log_path: Path, env: dict | None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*self.entry, *args],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def lost_its_port(self) -> bool:
        """Exited because the port chosen for it was taken meanwhile: worth starting again on another."""
        if self.process.poll() is None or self.attempts >= PORT_ATTEMPTS:
            return False
        self.log.flush()
        return PORT_TAKEN in self.log_path.read_text(errors="replace").lower()

    def restart_if_it_lost_its_port(self) -> None:
        if self.lost_its_port():
            self.log.close()
            self.attempts += 1
            self._launch()

    def ask_to_stop(self) -> None:
        """SIGTERM, continuing first a process a test stopped (SIGSTOP) and failed before continuing."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()

    def stop(self) -> None:
        self.ask_to_stop()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class ExecutorProcess(ServiceProcess):
    def __init__(
        self, model: str, redis_url: str, log_path: Path, *extra: str, env: dict | None = None
    ) -> None:
        self.id = f"test-{uuid.uuid4().hex[:8]}"
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        # what a crashed earlier run under this id would have left
        self.redis.sadd(keys.blocks_key(self.id), "stale")
        self.redis.hset(keys.load_key(self.id), "running", 99)
        self._launch = lambda: self._start_on_a_free_port(model, redis_url, log_path, extra, env)
        self._launch()

    def _start_on_a_free_port(self, model, redis_url, log_path, extra, env) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        args = ["executor", "--executor-id", self.id, "--bind", self.address, "--redis-url", redis_url]
        args += ["--model", model, "--kv-cache-memory", "8MiB", "--device", "cpu", *extra]
        self.start(args, log_path, env)

    def wait_registered(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.restart_if_it_lost_its_port()
            if self.process.poll() is not None:
                raise AssertionError(
                    f"executor exited {self.process.returncode}:\n{self.log_path.read_text()}"
                )
            if self.redis.exists(keys.executor_key(self.id)):
                return
            time.sleep(0.1)
        raise AssertionError(f"executor did not register in {timeout} s:\n{self.log_path.read_text()}")


class GatewayProcess(ServiceProcess):
    """`kvserve gateway` serving `model` as "tiny"; env adds to this process's environment. With --metrics-port
    among its flags, metrics_url is that listener's page."""

    def __init__(
        self, model: str, redis_url: str, log_path: Path, *extra: str, env: dict | None = None
    ) -> None:
        args = ["gateway", "--model", model, "--served-model-name", "tiny", "--redis-url", redis_url]
        if "--metrics-port" in extra:
            self.metrics_url = f"http://127.0.0.1:{extra[extra.index('--metrics-port') + 1]}/metrics"
        self._launch = lambda: self._start_on_a_free_port(args, log_path, extra, env)
        self._launch()

    def _start_on_a_free_port(self, args, log_path, extra, env) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.start([*args, "--port", str(self.port), *extra], log_path, env)

    def _status(self, path: str) -> int | None:
        """GET path's status, None while nothing answers."""
        self.restart_if_it_lost_its_port()
        try:
            return httpx.get(f"{self.base}{path}").status_code
        except httpx.HTTPError:
            return None

    def healthy(self) -> bool:
        return self._status("/health") == 200

    def live(self) -> bool:
        """Answering: without a live executor /health is a 503, /health/live a 200."""
        return self._status("/health/live") == 200

    def wait_healthy(self, timeout: float = 60.0) -> None:
        if not eventually(self.healthy, timeout=timeout):
            raise AssertionError(f"gateway not healthy in {timeout} s:\n{self.log_path.read_text()}")

    def wait_listening(self, timeout: float = 60.0) -> None:
        if not eventually(self.live, timeout=timeout):
            raise AssertionError(f"gateway not listening in {timeout} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        """Without the drain's linger (gateway.server.draining.DRAINED_LINGER_S): the second signal, ServiceProcess.stop's,
        stops it at once."""
        self.ask_to_stop()
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(0.5)
        super().stop()


def start_valkey_as_shipped(args: list[str], data_dir: Path, password: str) -> tuple[subprocess.Popen, str]:
    """valkey-server run with a deployment's own arguments (compose's command, the manifest's args): its
    password reference filled in, its data folder, port and address moved here. Returns it and its URL."""
    from kvserve.redis_server import _wait_for_ping, find_server_binary

    words = list(args[1:] if args[0] == "valkey-server" else args)
    words[words.index("--requirepass") + 1] = password
    words[words.index("--dir") + 1] = str(data_dir)
    port = free_port()
    words += ["--port", str(port), "--bind", "127.0.0.1", "--logfile", str(data_dir / "server.log")]
    process = subprocess.Popen([find_server_binary(), *words], stdout=subprocess.DEVNULL)
    assert _wait_for_ping("127.0.0.1", port, process, 10), (data_dir / "server.log").read_text()
    return process, f"redis://:{password}@127.0.0.1:{port}/0"


def keeps_data_across_a_kill(args: list[str], data_dir: Path) -> int:
    """A key written (and fsync'd: everysec) survives kill -9 and a start from the same arguments; no key is ever
    evicted to make room (a bounded memory whose policy is noeviction); a client without the password gets
    nothing. Returns the maxmemory the server read from args, in bytes."""
    password = uuid.uuid4().hex
    process, url = start_valkey_as_shipped(args, data_dir, password)
    try:
        redis.Redis.from_url(url).set("kvserve:test:durable", "yes")
        time.sleep(1.5)  # appendfsync everysec
        process.kill()
        process.wait()
        process, url = start_valkey_as_shipped(args, data_dir, password)
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.get("kvserve:test:durable") == "yes"
        memory = client.config_get("maxmemory*")
        assert int(memory["maxmemory"]) > 0 and memory["maxmemory-policy"] == "noeviction", memory
        try:
            redis.Redis.from_url(url.replace(f":{password}@", "")).ping()
            raise AssertionError("a client without the password was served")
        except redis.AuthenticationError:
            pass
    finally:
        process.kill()
        process.wait()
    return int(memory["maxmemory"])


def raw_generate(
    address: str, wait_s: float, client_keys: tuple[bytes, bytes, bytes] | None = None
) -> bytes | None:
    """Send a valid GenerateRequest from a bare DEALER (plain, or CURVE with (public, secret, server public))
    and return the executor's first reply within wait_s, or None when nothing came."""
    import zmq

    from shared import protocol
    from shared.block_hash import hash_blocks

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    if client_keys is not None:
        socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = client_keys
    try:
        socket.connect(address)
        prompt = list(range(100, 120))
        request = protocol.GenerateRequest(
            f"raw-{uuid.uuid4().hex[:8]}", prompt, hash_blocks(prompt, 16), {"max_tokens": 2}
        )
        socket.send(protocol.encode(request))
        return socket.recv() if socket.poll(int(wait_s * 1000)) else None
    finally:
        socket.close(linger=0)
        context.term()
