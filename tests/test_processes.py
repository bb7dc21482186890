"""The test harness's own promise: a port taken between choosing it and binding it costs a restart, not a test."""

import socket

import tests.processes as processes
from kvserve.redis_server import start_redis_server


def test_an_executor_whose_port_was_taken_starts_again_on_another(tiny_models, tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real = processes.free_port
        monkeypatch.setattr(processes, "free_port", lambda: next(ports, None) or real())
        server = start_redis_server()
        executor = processes.ExecutorProcess(tiny_models["llama"], server.url, tmp_path / "executor.log")
        try:
            first = executor.address
            executor.wait_registered()
            assert executor.attempts == 2 and executor.address != first
        finally:
            executor.stop()
            server.stop()
