"""What `kvserve up` runs beside its gateway: the embedded Redis (unless --redis-url) and N executors, child
processes kept alive by a Supervisor.

Each child has a process group of its own, so Ctrl-C at a terminal reaches only `kvserve up`, which stops them
in order once its gateway has drained: the executors first, then the Redis they deregister from. Each also dies
(SIGKILL) with `kvserve up` however it ends, kill -9 included (shared/parent_death.py). A restarted
executor keeps its id and its address (a new free port only if another process took it); the embedded Redis
comes back on its port with its data (an append-only file), so every URL and API key stays valid.

The embedded Redis keeps its data in the data directory (kvserve/data_dir.py), which this stack holds for its run
(kvserve/store.py: a second `kvserve up` on it is refused). It listens on loopback only and requires the folder's
random password: other local users cannot reach the stack's keys and registrations. Executors get its URL in their
environment (a command line is readable by every user); logs show it masked, and the whole URL is in a file only
this user can read, where `kvserve keys` finds it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import redis

from kvserve.data_dir import DataDir
from kvserve.redis_server import EmbeddedRedis, free_port
from kvserve.store import Claim, claim
from kvserve.supervisor import Supervisor, describe_exit, stop_processes
from shared import redis_keys
from shared.child_env import engine_environment
from shared.parent_death import dying_with_this_process
from shared.redis_url import masked

log = logging.getLogger("kvserve.up")

REDIS = "redis"  # the embedded server's name in log lines and messages
EXECUTOR_START_TIMEOUT_S = 600  # the first start may pull and convert the default model
# an executor told to stop after the gateway drained has nothing left to run: one still there after this is
# stuck, and is killed
STOP_TIMEOUT_S = 3.0
HOST = "127.0.0.1"


class StackError(RuntimeError):
    pass


@dataclass(slots=True)
class ExecutorPlan:
    count: int
    flags: list[str]  # for every `kvserve executor`, after its id, address and Redis URL
    device: str
    niceness: int  # CPU executors run this much below the gateway
    # the disk tier's directory: each executor gets a folder of its own there, by its id, so a restarted one
    # finds its blocks again (None: no disk tier)
    kv_offload_dir: str | None = None
    # each executor serves its KV blocks to the others on a port of its own (with several: a request routed
    # away from the executor holding its prefix pulls it rather than computes it)
    kv_transfer: bool = False


class LocalStack:
    def __init__(self, plan: ExecutorPlan, redis_url: str | None, data: DataDir | None) -> None:
        self.plan = plan
        self.redis_url = redis_url
        self.data = data  # where the embedded Redis keeps its data: given when redis_url is not
        self.claim: Claim | None = None
        self.embedded: EmbeddedRedis | None = None
        self.addresses: dict[str, str] = {}  # executor id -> ZeroMQ address, kept across restarts
        self.transfer_ports: dict[str, int] = {}  # executor id -> its KV transfer port, likewise
        self.supervisor = Supervisor(on_death=self._forget_executor)
        self._client: redis.Redis | None = None

    def start(self) -> None:
        """Redis, then the executors; returns once every executor has registered. Whatever happens, the
        caller ends with stop()."""
        if self.redis_url is None:
            self.claim = claim(self.data)
            self.embedded = self.claim.start_server()
            self.redis_url = self.embedded.url
            self.supervisor.adopt(REDIS, self.embedded.process, self.embedded.restart)
            self.claim.publish(self.redis_url)
            log.info(
                "embedded Redis at %s (the whole URL, for `kvserve keys`: %s), its data in %s",
                masked(self.redis_url),
                self.data.url_file,
                self.data.path,
            )
        self._client = redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
        for i in range(self.plan.count):
            executor_id = f"executor-{i}"
            self.addresses[executor_id] = f"tcp://{HOST}:{free_port(HOST)}"
            self.supervisor.start(executor_id, functools.partial(self._start_executor, executor_id))
        self._wait_for_executors()

    def watch(self, on_failure) -> None:
        """Restart children that die from now on; on_failure(message) once one keeps dying."""
        self.supervisor.watch(on_failure)

    def hold(self) -> None:
        """Shutting down: children that exit from now on stay down."""
        self.supervisor.hold()

    @property
    def failure(self) -> str | None:
        return self.supervisor.failure

    def stop(self) -> None:
        """Stop exactly what this stack started: the executors, then the embedded Redis."""
        self.supervisor.halt()
        executors = [self.supervisor.process(i) for i in self.addresses if i in self.supervisor.children]
        stop_processes(executors, STOP_TIMEOUT_S)
        if self.claim is not None:
            self.claim.unpublish()
        if self.embedded is not None:
            self.embedded.stop()
        if self.claim is not None:
            self.claim.release()

    def _start_executor(self, executor_id: str) -> subprocess.Popen:
        address = self.addresses[executor_id]
        if not _can_bind(address):
            moved = f"tcp://{HOST}:{free_port(HOST)}"
            log.warning("%s: %s is taken by another process, moving to %s", executor_id, address, moved)
            address = self.addresses[executor_id] = moved
        argv = [sys.executable, "-m", "kvserve.cli", "executor", "--executor-id", executor_id]
        argv += ["--bind", address, *self.plan.flags]
        if self.plan.kv_offload_dir is not None:
            argv += ["--kv-offload-dir", os.path.join(self.plan.kv_offload_dir, executor_id)]
        if self.plan.kv_transfer:
            port = self.transfer_ports.get(executor_id)
            if port is None or not _can_bind(f"tcp://{HOST}:{port}"):
                port = self.transfer_ports[executor_id] = free_port(HOST)
            argv += ["--kv-transfer-port", str(port)]
        return start_executor(argv, self.redis_url, self.plan.count, self.plan.device, self.plan.niceness)

    def _forget_executor(self, name: str) -> None:
        """A dead executor's registration goes at once, not when its heartbeat would have expired: gateways
        stop routing to it, and requests waiting on it are retried elsewhere, before it is back."""
        if name not in self.addresses or self._client is None:
            return
        try:
            pipe = self._client.pipeline()
            pipe.delete(*redis_keys.executor_keys(name))
            pipe.srem(redis_keys.EXECUTORS, name)
            pipe.execute()
        except redis.RedisError as error:
            log.warning(
                "%s: could not remove its registration (it expires with its heartbeat): %s", name, error
            )

    def _wait_for_executors(self) -> None:
        deadline = time.monotonic() + EXECUTOR_START_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, child in self.supervisor.children.items():
                if child.process.poll() is not None:
                    how = describe_exit(child.process.returncode)
                    raise StackError(
                        f"{name} exited while the stack started ({how}); its log lines are above"
                    )
            try:
                if all(self._client.exists(redis_keys.executor_key(i)) for i in self.addresses):
                    return
            except redis.RedisError as error:  # its Redis restarting under the supervisor: ask again
                log.debug("waiting for the executors' registrations: %s", error)
            time.sleep(0.2)
        raise StackError(f"executors did not register within {EXECUTOR_START_TIMEOUT_S} s")


def start_executor(
    argv: list[str], redis_url: str, num_executors: int, device: str, niceness: int
) -> subprocess.Popen:
    """One executor child process, given what an engine reads of this environment (shared/child_env.py) and the
    Redis URL (KVSERVE_REDIS_URL), where its password is hidden from other users. CPU executors split this
    machine's cores between them (oversubscribed OpenMP threads spin against each other: two executors with two
    threads each on two cores ran several times slower) unless OMP_NUM_THREADS is set, and run `niceness` below
    the gateway."""
    env = {**engine_environment(), "KVSERVE_REDIS_URL": redis_url}
    on_cpu = device != "cuda"
    if on_cpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // num_executors)))
    process = subprocess.Popen(dying_with_this_process(argv), env=env, process_group=0)
    if on_cpu and niceness:
        # set from here, not in the child before exec: the supervisor's thread starts executors, and a
        # preexec_fn is unsafe in a process with threads. Threads the child starts later inherit it.
        with contextlib.suppress(ProcessLookupError):  # it may have died already: the supervisor will see
            nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
            os.setpriority(os.PRIO_PROCESS, process.pid, nice)
    return process


def _can_bind(address: str) -> bool:
    """Whether a listener could take this tcp:// address now (as ZeroMQ binds: SO_REUSEADDR, so the TIME_WAIT
    connections a killed executor leaves do not count)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True
