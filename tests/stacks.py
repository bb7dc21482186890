"""Serving stacks for tests: a Redis of their own, executors and gateways as processes, stopped by their PIDs.

    with serving_stack(model, logs, executors=2, gateways=[("--metrics-port", port), ()]) as stack:
        httpx.get(f"{stack.gateway.base}/health")

`executors` and `gateways` are a count, or one tuple of flags per process; `executor_flags` and `gateway_flags`
go to every process of the kind; `env` adds to every process's environment. Keys for `tenants` are made before
any gateway starts (a gateway with --require-api-key refuses to start without one). The read-only HTTP tests
share the gateway package's stacks (tests/gateway/conftest.py: `open_stack`, `keyed_stack`, `default_model_stack`);
a test that kills, stops, drains or restarts a process, or needs flags of its own, starts one here."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from gateway.tenants.api_keys import KeyStore
from kvserve.redis_server import EmbeddedRedis, start_redis_server
from tests.processes import ExecutorProcess, GatewayProcess, ServiceProcess

Flags = Sequence[str]
# the first executor in a fresh checkout builds the CPU kernels (about a minute on two cores) and the others wait
EXECUTOR_START_S = 180.0
GATEWAY_START_S = 120.0


@dataclass
class Stack:
    """A running stack; a module may add a gateway or executor of its own to a shared one, and remove it."""

    model: str
    logs: Path
    server: EmbeddedRedis
    env: dict[str, str] = field(default_factory=dict)
    executors: list[ExecutorProcess] = field(default_factory=list)
    gateways: list[GatewayProcess] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> an API key of it

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def gateway(self) -> GatewayProcess:
        return self.gateways[0]

    @property
    def executor(self) -> ExecutorProcess:
        return self.executors[0]

    @property
    def base(self) -> str:
        return self.gateway.base

    @property
    def redis(self) -> redis.Redis:
        """A client of the stack's Redis, replies as text."""
        return redis.Redis.from_url(self.url, decode_responses=True)

    def key_store(self) -> KeyStore:
        return KeyStore(self.redis)

    def restart_redis(self, down_s: float) -> float:
        """Stop Redis as a crash would (its keys are lost: no persistence), wait down_s, start it again on the
        same port, so every client's URL stays valid; returns time.monotonic() when it answers again."""
        self.server.kill()
        time.sleep(down_s)
        self.server.restart()
        return time.monotonic()

    def start_executor(self, *flags: str, env: dict | None = None) -> ExecutorProcess:
        """Started, not yet registered: wait_registered() when it should serve."""
        log = self.logs / f"executor-{len(self.executors)}.log"
        executor = ExecutorProcess(self.model, self.url, log, *flags, env={**self.env, **(env or {})})
        self.executors.append(executor)
        return executor

    def start_gateway(self, *flags: str, env: dict | None = None, name: str | None = None) -> GatewayProcess:
        """Started, not yet answering: wait_healthy() (or wait_listening() without executors)."""
        log = self.logs / f"{name or f'gateway-{len(self.gateways)}'}.log"
        gateway = GatewayProcess(self.model, self.url, log, *flags, env={**self.env, **(env or {})})
        self.gateways.append(gateway)
        return gateway

    def add_executor(self, *flags: str, env: dict | None = None) -> ExecutorProcess:
        executor = self.start_executor(*flags, env=env)
        executor.wait_registered(EXECUTOR_START_S)
        return executor

    def add_gateway(self, *flags: str, env: dict | None = None, name: str | None = None) -> GatewayProcess:
        gateway = self.start_gateway(*flags, env=env, name=name)
        self._wait_serving(gateway)
        return gateway

    def remove(self, process: ServiceProcess) -> None:
        """Stop one process of the stack (a gateway or executor a module added for itself)."""
        process.stop()
        for started in (self.gateways, self.executors):
            if process in started:
                started.remove(process)

    def _wait_serving(self, gateway: GatewayProcess) -> None:
        if self.executors:
            gateway.wait_healthy(GATEWAY_START_S)
        else:  # without executors /health is a 503, but the gateway is up
            gateway.wait_listening(GATEWAY_START_S)

    def stop(self) -> None:
        processes = (*self.gateways, *self.executors)
        for process in processes:  # all at once: their shutdowns overlap
            process.ask_to_stop()
        for process in processes:
            process.stop()
        self.server.stop()


def _flag_sets(processes: int | Sequence[Flags]) -> list[Flags]:
    return [()] * processes if isinstance(processes, int) else list(processes)


@contextmanager
def serving_stack(
    model: str,
    logs: Path,
    *,
    executors: int | Sequence[Flags] = 1,
    gateways: int | Sequence[Flags] = 1,
    executor_flags: Flags = (),
    gateway_flags: Flags = (),
    env: dict[str, str] | None = None,
    tenants: Sequence[str] = (),
) -> Iterator[Stack]:
    """A Redis of its own (no other test's executors or keys seen), its executors registered and its gateways
    answering; every process stopped by its PID on the way out, stopped (SIGSTOP) ones included."""
    stack = Stack(model, logs, start_redis_server(), dict(env or {}))
    try:
        stack.keys = {tenant: stack.key_store().create(tenant)[0] for tenant in tenants}
        for flags in _flag_sets(executors):  # all start at once; their imports overlap
            stack.start_executor(*executor_flags, *flags)
        for flags in _flag_sets(gateways):
            stack.start_gateway(*gateway_flags, *flags)
        for executor in stack.executors:
            executor.wait_registered(EXECUTOR_START_S)
        for gateway in stack.gateways:
            stack._wait_serving(gateway)
        yield stack
    finally:
        stack.stop()
