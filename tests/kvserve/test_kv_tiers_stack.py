"""Issue 48's tiers through real processes: `kvserve up` with two executors pulls a prefix from the one that
holds it when round robin sends a revisit to the other, and a restarted `kvserve up` serves revisits from each
executor's disk tier (a folder of its own), the same greedy text as before."""

from __future__ import annotations

import re
import signal
import stat
import subprocess
from collections import Counter
from contextlib import suppress
from pathlib import Path

import httpx
import pytest
import redis

from shared import redis_keys
from shared.block_hash import max_cached_blocks
from tests.kvserve.up_process import Up
from tests.processes import eventually

BLOCK_SIZE = 16  # the executors' default
TIER_FLAGS = ("--max-model-len", "1024", "--kv-offload-disk", "16MiB")


def document(topic: str) -> str:
    """A prompt of about 300 tokens, its own from the first token on, so no other prompt's blocks serve it."""
    return f"{topic}: " + " ".join(f"{topic}-{i} item {i * 7 % 13}" for i in range(42))


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def full_blocks(response: httpx.Response) -> int:
    """The prompt's tokens a prefix-cache hit may cover: its whole blocks, short of the last token."""
    return max_cached_blocks(response.json()["usage"]["prompt_tokens"], BLOCK_SIZE) * BLOCK_SIZE


def kv_blocks(response: httpx.Response) -> int:
    """Whole blocks of what the executor computed: the prompt and every generated token but the last."""
    usage = response.json()["usage"]
    return (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // BLOCK_SIZE


def text(response: httpx.Response) -> str:
    return response.json()["choices"][0]["text"]


def served_by(response: httpx.Response) -> str:
    return response.headers["x-kvserve-executor"]


class TieredUp(Up):
    """`kvserve up` with a disk tier under offload_dir; remembers which executor served which prompt, so a test
    knows what each executor's disk tier must hold."""

    def __init__(self, model: str, log_path: Path, offload_dir: Path, *extra: str, **kwargs) -> None:
        super().__init__(model, log_path, "--kv-offload-dir", str(offload_dir), *TIER_FLAGS, *extra, **kwargs)
        self.served: dict[tuple[str, str], int] = {}  # (executor, prompt) -> KV blocks it computed or got

    def send(self, prompt: str) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{self.base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        self.served[served_by(response), prompt] = kv_blocks(response)
        return response

    def metric(self, name: str, executor: str) -> float:
        """A per-executor series of the gateway's /metrics (0 while absent)."""
        page = httpx.get(f"{self.base}/metrics", timeout=10).text
        found = re.search(rf'^{name}\{{[^}}]*executor="{executor}"[^}}]*\}} (\S+)$', page, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def metrics_reach(self, name: str, executor: str, least: float) -> bool:
        """Executors publish their stats every few seconds: wait for the gateway's page to show them."""
        return eventually(lambda: self.metric(name, executor) >= least, timeout=15)

    def publishes(self, key: str, blocks: int) -> bool:
        """The executors publish their blocks after a step, and their tiers' sets after registering: wait for
        Redis to show at least blocks of them in key, as a gateway routing now would see them."""
        client = redis.Redis.from_url(self.redis_url())
        return eventually(lambda: client.scard(key) >= blocks, timeout=10)

    def terminate(self) -> None:
        """SIGTERM, as a service manager stops it, and its exit awaited; then nothing left behind."""
        self.children()
        self.process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(60)
        self.stop()
        assert self.process.returncode == 0, self.text()


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-tiers") / "kv"


@pytest.fixture(scope="module")
def first_run(tiny_models, offload_dir):
    """Two executors, round robin: a revisit goes to the executor that did not serve the first visit. The
    restart test ends it, so it comes last."""
    logs = offload_dir.parent
    up = TieredUp(
        tiny_models["llama"], logs / "first.log", offload_dir, "--routing-policy", "round_robin",
        data_dir=logs / "data",
    )  # fmt: skip
    try:
        up.wait_serving(2)
        yield up
    finally:
        up.stop()


@pytest.mark.slow
def test_a_revisit_round_robin_sends_to_the_other_executor_pulls_the_prefix_and_answers_alike(first_run):
    prompt = document("pull")
    first = first_run.send(prompt)
    holder = served_by(first)
    assert cached_tokens(first) == 0
    assert first_run.publishes(redis_keys.blocks_key(holder), full_blocks(first) // BLOCK_SIZE)
    second = first_run.send(prompt)
    puller = served_by(second)
    assert puller != holder
    assert cached_tokens(second) == full_blocks(first) > 0, first_run.text()
    assert text(second) == text(first)
    assert first_run.metrics_reach("kvserve_kv_peer_cached_tokens_total", puller, full_blocks(first))
    assert first_run.metric("kvserve_kv_pulls_total", puller) >= 1
    assert first_run.metric("kvserve_kv_pulls_failed_total", puller) == 0


@pytest.mark.slow
def test_a_restarted_stack_serves_revisits_from_each_executors_disk_tier(first_run, offload_dir, tiny_models):
    prompts = [document(topic) for topic in ("alpha", "bravo", "charlie", "delta")]
    firsts = [first_run.send(prompt) for prompt in prompts]
    assert [cached_tokens(first) for first in firsts] == [0] * len(prompts)
    assert {served_by(first) for first in firsts} == {"executor-0", "executor-1"}  # round robin
    first_run.terminate()

    # one file per block each executor computed or pulled, 0600 in a 0700 folder of its own
    files_per_executor = Counter()
    for (executor, _prompt), blocks in first_run.served.items():
        files_per_executor[executor] += blocks
    for executor, count in files_per_executor.items():
        folder = offload_dir / executor
        files = list(folder.iterdir())
        assert len(files) == count, (executor, sorted(f.name for f in files))
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}

    # routing by tier: each revisit goes to the executor whose disk holds its prefix, and loads it from there
    up = TieredUp(
        tiny_models["llama"], offload_dir.parent / "second.log", offload_dir, data_dir=first_run.data_dir
    )
    try:
        up.wait_serving(2)
        for executor, count in files_per_executor.items():
            assert up.publishes(redis_keys.tier_key(executor, "disk"), count)
        revisits = [up.send(prompt) for prompt in prompts]
        for first, revisit in zip(firsts, revisits, strict=True):
            assert cached_tokens(revisit) == full_blocks(first) > 0, up.text()
            assert text(revisit) == text(first)
            assert served_by(revisit) == served_by(first)
        for executor in ("executor-0", "executor-1"):
            from_disk = sum(full_blocks(f) for f in firsts if served_by(f) == executor)
            assert up.metrics_reach("kvserve_kv_disk_cached_tokens_total", executor, from_disk)
            assert up.metric("kvserve_kv_disk_cached_tokens_total", executor) == from_disk
            assert up.metric("kvserve_kv_peer_cached_tokens_total", executor) == 0
    finally:
        up.stop()
