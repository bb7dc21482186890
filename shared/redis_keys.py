"""Every Redis key kvserve uses, in one place: the executor index (executor/service/index_writer.py writes it,
gateway/routing/index_reader.py reads it), tenants' API keys and usage.

Layout (`<id>` is an executor id):
- `kvserve:executors`                 set of executor ids that registered. A set member cannot expire on its own,
                                      so a reader treats an id whose info hash is gone as dead.
- `kvserve:executor:<id>`             hash, the registration: address, model, block_size, kv_blocks_total,
                                      max_model_len, max_waiting_seqs (one tenant's queue bound),
                                      waiting_tenants_share (all tenants' bound is that many times it; 1: one bound
                                      for all, fair share off), started_at; and, optional (absent: no KV pulls to
                                      or from it), kv_transfer_address (the tcp:// endpoint its KV transfer server
                                      answers pulls on) and kv_fingerprint (hex digest of what makes its KV blocks
                                      interchangeable: model, dtype, block shape, quantization; executors pull only
                                      from one with the same); lora_adapters (JSON: the LoRA adapters it serves,
                                      name -> digest of their files; absent: none), lora_refused (JSON: name ->
                                      {"path", "error"}: the path of LORA_ADAPTERS's entry tried and why it could
                                      not be served here) and max_loras
                                      (distinct adapters its running requests may use). Its TTL is the heartbeat: refreshed every
                                      HEARTBEAT_INTERVAL_S, gone HEARTBEAT_TTL_S after the executor stops.
- `kvserve:executor:<id>:blocks`      set of the hex block hashes (shared.block_hash) the executor holds cached in
                                      its KV pool, and BLOCKS_MARKER (not hex: never a hash). A set without the
                                      marker was lost (Redis restarted, failed over, evicted it): the executor's
                                      next heartbeat notices and it writes the whole set again.
- `kvserve:executor:<id>:host`        the same for the blocks its host-memory tier holds, and
- `kvserve:executor:<id>:disk`        its disk tier (TIERS): same marker, same republishing, whether or not the
                                      tier is on (off: the marker alone). A block may be in several; routing
                                      counts the best (pool, then host, then disk).
- `kvserve:executor:<id>:load`        hash: running, waiting, compiling, prefill_tokens, kv_usage, kv_filled, queue_full,
                                      waiting_max_tenant (executor.step_result.EngineStats.load), updated_at; with
                                      LoRA, lora_running and lora_held (adapter names, comma-separated: those its
                                      running requests use, those its host memory holds).
- `kvserve:executor:<id>:inflight`    counter the gateways keep: prompt tokens to prefill of requests routed there
                                      whose first update has not come back yet, so not in the executor's load (a
                                      burst of arrivals would otherwise all see the same idle executor). Its own
                                      TTL, INFLIGHT_TTL_S from the last routing, bounds drift from a dead gateway.
- `kvserve:executor:<id>:stats`       hash: the executor's cumulative counters, gauges and queue-time histogram
                                      (shared.executor_stats), read by every gateway's /metrics.
- `kvserve:gateway:round_robin`       counter the gateways share for the round_robin routing policy.
- `kvserve:lora:adapters`             hash: LoRA adapters loaded at run time (POST /v1/load_lora_adapter), name ->
                                      JSON {"path": its PEFT directory}; every executor with --enable-lora serves
                                      them from its next heartbeat (those of --lora-modules beside them).
All of an executor's keys carry the heartbeat TTL, so a dead executor's entries expire together.

Tenancy (`<key_id>` is an API key's public id, `<tenant>` a tenant name):
- `kvserve:apikeys`                   set of the key ids that are active (created, not revoked).
- `kvserve:apikeys:keyed`             string (when it was set): this deployment has had keys. Creating or importing a
                                      key sets it and nothing clears it, so revoking the last key never opens the
                                      gateways (gateway.tenants.tenancy); deleting it by hand is how an operator reopens.
- `kvserve:apikey:<key_id>`           hash: the key's record (gateway.tenants.api_keys); the secret only as a hash.
- `kvserve:tenant:<tenant>`           hash: cache_salt, the tenant's secret that salts its block hashes.
- `kvserve:tenant:<tenant>:usage`     hash of counters: requests, prompt_tokens, cached_tokens (and split by
                                      where their KV came from: cached_tokens_pool, _host, _disk, _peer),
                                      computed_prompt_tokens, completion_tokens, kv_block_seconds (a float),
                                      rejected (docs/tenancy.md, "Usage and billing")
- `kvserve:limit:<key_id>:*`          the key's rate-limit state (gateway.tenants.rate_limits).
- `<key>:applied:<write id>`         string, APPLIED_TTL_S: a write to key (a request's admission or usage under an
                                      API key's limits, one change of an in-flight count) was applied, so a retry
                                      after a lost reply applies it once (gateway.routing.index_reader.APPLY_ONCE).
"""

from __future__ import annotations

import re

EXECUTORS = "kvserve:executors"
ROUND_ROBIN = "kvserve:gateway:round_robin"  # counter shared by every gateway replica
LORA_ADAPTERS = "kvserve:lora:adapters"  # adapters loaded at run time: name -> JSON {"path": ...}
HEARTBEAT_TTL_S = 5
HEARTBEAT_INTERVAL_S = 1.0
INFLIGHT_TTL_S = 30
BLOCKS_MARKER = "complete"

_EXECUTOR_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_executor_id(executor_id: str) -> str:
    """Ids become key parts: a ':' would let one executor's keys alias another's."""
    if not _EXECUTOR_ID.fullmatch(executor_id):
        raise ValueError(f"executor_id: {executor_id!r} must be 1-128 of A-Z a-z 0-9 _ . -")
    return executor_id


def executor_key(executor_id: str) -> str:
    return f"kvserve:executor:{executor_id}"


def blocks_key(executor_id: str) -> str:
    return f"kvserve:executor:{executor_id}:blocks"


# the executor's KV tiers below its pool, each with a set of the hashes it holds (executor/kv/tiers/)
TIERS = ("host", "disk")


def tier_key(executor_id: str, tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"tier: {tier!r} is not one of {', '.join(TIERS)}")
    return f"kvserve:executor:{executor_id}:{tier}"


def load_key(executor_id: str) -> str:
    return f"kvserve:executor:{executor_id}:load"


def inflight_key(executor_id: str) -> str:
    return f"kvserve:executor:{executor_id}:inflight"


def stats_key(executor_id: str) -> str:
    return f"kvserve:executor:{executor_id}:stats"


def executor_keys(executor_id: str) -> list[str]:
    """Every key one executor owns."""
    return [
        executor_key(executor_id),
        blocks_key(executor_id),
        *(tier_key(executor_id, tier) for tier in TIERS),
        load_key(executor_id),
        stats_key(executor_id),
    ]


API_KEYS = "kvserve:apikeys"
KEYED_DEPLOYMENT = "kvserve:apikeys:keyed"


def api_key_key(key_id: str) -> str:
    return f"kvserve:apikey:{key_id}"


def tenant_key(tenant: str) -> str:
    return f"kvserve:tenant:{tenant}"


def tenant_usage_key(tenant: str) -> str:
    return f"kvserve:tenant:{tenant}:usage"


def limit_key(key_id: str, kind: str) -> str:
    """kind: rpm, tpm or concurrency; request:<request id> is the prefix of that request's writes' markers."""
    return f"kvserve:limit:{key_id}:{kind}"


# a command is retried once, at most seconds after its first try (gateway.routing.index_reader.connect): the marker
# outlives that by far, and costs Redis a short string per request meanwhile
APPLIED_TTL_S = 60


def applied_key(key: str, write_id: str) -> str:
    """The marker that one write to key (named by its request and what it did, or by a call's own id) was applied."""
    return f"{key}:applied:{write_id}"
