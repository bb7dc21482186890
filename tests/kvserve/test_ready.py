"""`kvserve ready`: the executors' readiness probe (Kubernetes, compose) reads the registration the executor's own
index writer makes."""

from __future__ import annotations

import redis

from executor.service.index_writer import IndexWriter
from kvserve.cli import main
from kvserve.redis_server import start_redis_server


def test_ready_only_while_the_executor_is_registered(capsys, monkeypatch):
    server = start_redis_server(password="probe-password")
    try:
        monkeypatch.setenv("KVSERVE_REDIS_URL", server.url)  # as the pod's environment gives it
        assert main(["ready", "--executor-id", "kvserve-executor-0"]) == 1
        assert "executor kvserve-executor-0 is not registered" in capsys.readouterr().err

        writer = IndexWriter(redis.Redis.from_url(server.url), "kvserve-executor-0")
        writer.register({"address": "tcp://kvserve-executor-0.kvserve-executor.ns.svc:5600", "model": "m"})
        assert main(["ready", "--executor-id", "kvserve-executor-0"]) == 0
        monkeypatch.setenv("KVSERVE_EXECUTOR_ID", "kvserve-executor-0")  # as the pod's probe inherits it
        assert main(["ready"]) == 0
        assert main(["ready", "--executor-id", "kvserve-executor-1"]) == 1  # another's is not ours
        writer.deregister()
        assert main(["ready", "--executor-id", "kvserve-executor-0"]) == 1

        wrong = server.url.replace("probe-password", "wrong")
        assert main(["ready", "--executor-id", "kvserve-executor-0", "--redis-url", wrong]) == 1
        err = capsys.readouterr().err
        assert "refused the URL's password" in err
        assert "probe-password" not in err and ":wrong@" not in err
    finally:
        server.stop()
