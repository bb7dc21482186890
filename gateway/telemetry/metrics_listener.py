"""`/metrics` on a listener of its own (`--metrics-port`), as Prometheus deployments expect, so the public port
need not show tenant names. Same process and registry: a second uvicorn server on the gateway's event loop, started
and stopped with the gateway's app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

log = logging.getLogger("kvserve.gateway")


class _Listener(uvicorn.Server):
    """Leaves SIGINT/SIGTERM to the gateway's own server, whose shutdown ends this one."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class MetricsListener:
    def __init__(self, app, host: str, port: int) -> None:
        self.host, self.port = host, port
        config = uvicorn.Config(
            app, lifespan="off", access_log=False, log_config=None, timeout_graceful_shutdown=5
        )
        self.server = _Listener(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        """Binds here, so a taken port is an error naming it rather than uvicorn's exit from inside a task."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as error:
            sock.close()
            raise RuntimeError(f"--metrics-port: cannot listen on {self.host}:{self.port}: {error}") from None
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # its exception, if it had one
                raise RuntimeError(
                    f"--metrics-port: the listener on {self.host}:{self.port} stopped at start"
                )
            await asyncio.sleep(0.01)
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self.task is not None:
            self.server.should_exit = True
            await self.task
