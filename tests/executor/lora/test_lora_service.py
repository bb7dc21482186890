"""An executor process serving LoRA adapters: it registers them with their digests, answers a request under an
adapter as the offline API does (block hashes agreeing with what the gateway computes), publishes which adapters
run and which host memory holds, and serves the run-time registry in Redis from its next heartbeat: added, refused
with the reason, removed."""

from __future__ import annotations

import json
import time

import pytest

from executor.lora.adapter_files import files_digest
from shared import protocol
from shared import redis_keys as keys
from shared.block_hash import adapter_salt, hash_blocks
from shared.tenant import Tenant
from tests.executor.test_service import Gateway
from tests.processes import ExecutorProcess

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def executor(tiny_models, adapters, redis_url, tmp_path_factory):
    proc = ExecutorProcess(
        tiny_models["llama"],
        redis_url,
        tmp_path_factory.mktemp("lora-executor") / "log",
        "--quantization",
        "none",
        "--enable-lora",
        "--lora-modules",
        f"qv={adapters['qv'][0]}",
        "--max-loras",
        "2",
    )
    try:
        proc.wait_registered()
        yield proc
    finally:
        proc.redis.delete(keys.LORA_ADAPTERS)
        proc.stop()


def registration(executor, field: str) -> dict:
    return json.loads(executor.redis.hget(keys.executor_key(executor.id), field) or "{}")


def wait_for(condition, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError("not within the timeout")


def generate(gateway: Gateway, request_id: str, lora: str | None, digest: str | None = None) -> None:
    tenant = Tenant("t", cache_salt="salt")
    salt = tenant.cache_salt if lora is None else adapter_salt(tenant.cache_salt, f"{lora}@{digest}")
    gateway.send(
        protocol.GenerateRequest(
            request_id,
            PROMPT,
            hash_blocks(PROMPT, 16, salt),
            {"max_tokens": 8, "temperature": 0.0},
            tenant,
            lora=lora,
        )
    )


def test_an_adapters_requests_answer_as_offline_and_hash_as_the_gateway_does(executor, adapters, tiny_models):
    from executor import LLM, SamplingParams

    digest = files_digest(__import__("pathlib").Path(adapters["qv"][0]))
    assert registration(executor, "lora_adapters") == {"qv": digest}
    assert executor.redis.hget(keys.executor_key(executor.id), "max_loras") == "2"
    gateway = Gateway(executor.address)
    try:
        generate(gateway, "base", None)
        generate(gateway, "tuned", "qv", digest)
        generate(gateway, "unknown", "nope", "0")
        tokens, _, errors, _ = gateway.collect({"base", "tuned", "unknown"})
    finally:
        gateway.close()
    assert errors["unknown"].code == 400 and "no adapter named 'nope'" in errors["unknown"].message
    llm = LLM(
        tiny_models["llama"],
        kv_cache_memory="8MiB",
        quantization="none",
        enable_lora=True,
        lora_modules={"qv": adapters["qv"][0]},
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert tokens["tuned"] == llm.generate([PROMPT], greedy, lora="qv")[0].outputs[0].token_ids
    assert tokens["base"] == llm.generate([PROMPT], greedy)[0].outputs[0].token_ids != tokens["tuned"]
    stats = executor.redis.hgetall(keys.stats_key(executor.id))
    assert float(stats.get("block_hash_mismatches", 0)) == 0
    load = executor.redis.hgetall(keys.load_key(executor.id))
    assert load["lora_held"] == "qv" and load["lora_running"] == ""


def test_the_run_time_registry_is_served_refused_with_a_reason_and_dropped(executor, adapters, tmp_path):
    executor.redis.hset(
        keys.LORA_ADAPTERS,
        mapping={
            "all": json.dumps({"path": adapters["all"][0]}),
            "missing": json.dumps({"path": str(tmp_path / "nowhere")}),
            "qv": json.dumps({"path": adapters["mlp"][0]}),  # a --lora-modules name: never replaced
        },
    )
    served = wait_for(
        lambda: "all" in registration(executor, "lora_adapters") and registration(executor, "lora_adapters")
    )
    assert set(served) == {"qv", "all"}
    refused = registration(executor, "lora_refused")
    assert refused["missing"]["path"] == str(tmp_path / "nowhere")
    assert (
        "no adapter_config.json" in refused["missing"]["error"] and "--lora-modules" in refused["qv"]["error"]
    )
    gateway = Gateway(executor.address)
    try:
        generate(gateway, "runtime", "all", served["all"])
        tokens, reasons, errors, _ = gateway.collect({"runtime"})
        assert not errors and len(tokens["runtime"]) == 8
        executor.redis.hdel(keys.LORA_ADAPTERS, "all", "missing", "qv")
        wait_for(lambda: set(registration(executor, "lora_adapters")) == {"qv"})
        assert registration(executor, "lora_refused") == {}
        generate(gateway, "gone", "all", served["all"])
        _, _, errors, _ = gateway.collect({"gone"})
        assert errors["gone"].code == 400
    finally:
        gateway.close()
