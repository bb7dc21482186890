"""What a child process's environment keeps of its parent's."""

from __future__ import annotations

from shared.child_env import engine_environment, python_environment

PARENT = {
    "PATH": "/usr/bin",
    "HOME": "/home/me",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": "/src",
    "OMP_NUM_THREADS": "4",
    "CUDA_VISIBLE_DEVICES": "0",
    "HF_HOME": "/models/hf",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318",
    "KVSERVE_CACHE_DIR": "/models",
    "KVSERVE_REDIS_URL": "redis://:secret@127.0.0.1:6379/0",
    "KVSERVE_REDIS_PASSWORD": "secret",
    "AWS_SECRET_ACCESS_KEY": "another service's",
    "GITHUB_TOKEN": "another service's",
}


def test_a_python_child_gets_what_runs_python_and_no_secret():
    assert python_environment(PARENT) == {
        k: PARENT[k] for k in ("PATH", "HOME", "LC_ALL", "PYTHONPATH", "OMP_NUM_THREADS")
    }


def test_an_engine_gets_what_it_reads_and_no_secret():
    kept = engine_environment(PARENT)
    assert kept["CUDA_VISIBLE_DEVICES"] == "0" and kept["HF_HOME"] == "/models/hf"
    assert kept["KVSERVE_CACHE_DIR"] == "/models" and "OTEL_EXPORTER_OTLP_ENDPOINT" in kept
    assert python_environment(PARENT).items() <= kept.items()
    for secret in ("KVSERVE_REDIS_URL", "KVSERVE_REDIS_PASSWORD", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN"):
        assert secret not in kept
