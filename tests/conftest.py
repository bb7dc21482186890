"""Shared fixtures: the default model (pulled once) and tiny random-weight models of each family."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import TINY_FAMILIES, save_tiny_model, tiny_config

# two cores: one thread per xdist worker (two workers), both threads for a serial run. The executors a worker
# starts take their threads from OMP_NUM_THREADS: two each, beside the other worker's, would put several spinning
# OpenMP threads on each core
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def kvserve_home(tmp_path_factory):
    """A data directory of the session's own (KVSERVE_HOME, for this process and every one it starts): no test
    reaches the user's store (kvserve/data_dir.py); a test about the store gives its commands a folder of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_HOME", str(tmp_path_factory.mktemp("kvserve-home")))
        yield


@pytest.fixture(scope="session")
def default_model() -> str:
    """The default model's directory, pulled once; KVSERVE_TEST_MODEL names another in its place (the GPU
    session's stand-in: that machine cannot fetch the default model's package)."""
    if stand_in := os.environ.get("KVSERVE_TEST_MODEL"):
        return stand_in
    from executor.models.model_files import resolve_model

    return str(resolve_model(None))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, str]:
    """family -> directory of a tiny random model saved as safetensors, with the default model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    return {
        family: save_tiny_model(
            tmp_path_factory.mktemp(f"tiny-{family}"), tiny_config(family, len(tokenizer)), tokenizer
        )
        for family in TINY_FAMILIES
    }


@pytest.fixture(scope="session")
def default_shaped_model(tmp_path_factory, default_model) -> str:
    """The default model's config cut to two layers, random weights, with its tokenizer: its attention (9 heads
    sharing 3 kv heads of 64) takes the default model's kernel paths, at a fraction of its load and prefill."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(default_model)
    config.num_hidden_layers = 2
    return save_tiny_model(
        tmp_path_factory.mktemp("default-shaped"), config, AutoTokenizer.from_pretrained(default_model)
    )


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis-protocol server (kvserve.redis_server) for the whole session, stopped by its own PID."""
    from kvserve.redis_server import start_redis_server

    server = start_redis_server()
    yield server.url
    server.stop()
