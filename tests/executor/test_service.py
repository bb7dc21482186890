"""`kvserve executor` as a real process: a real ZeroMQ DEALER client, a real Redis server."""

import contextlib
import json
import os
import signal
import time

import msgpack
import pytest
import zmq

from shared import protocol
from shared import redis_keys as keys
from shared.block_hash import hash_blocks
from shared.executor_stats import ExecutorStats
from shared.tenant import ANONYMOUS_TENANT, Tenant
from tests.otlp_receiver import OtlpReceiver
from tests.processes import ExecutorProcess, eventually, free_port

PROMPT_A = list(range(100, 140))  # 40 tokens: two full blocks of 16
PROMPT_B = [5, 17, 23, 99, 1000, 2000, 7]


def whose(tenant: str | None) -> Tenant:
    """The tenant of that name (None: the anonymous tenant)."""
    return ANONYMOUS_TENANT if tenant is None else Tenant(tenant)


class Gateway:
    """The gateway's side of the wire, as a test client."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(address)
        self.seqs: dict[str, int] = {}  # request id -> the seq its next update must have

    def send(self, msg) -> None:
        if isinstance(msg, protocol.GenerateRequest):
            self.seqs.pop(msg.request_id, None)
        self.socket.send(protocol.encode(msg))

    def generate(self, request_id: str, prompt: list[int], tenant: str | None = None, **sampling) -> None:
        self.send(
            protocol.GenerateRequest(request_id, prompt, hash_blocks(prompt, 16), sampling, whose(tenant))
        )

    def receive(self, timeout: float = 20.0):
        if not self.socket.poll(int(timeout * 1000)):
            raise AssertionError(f"nothing from the executor in {timeout} s")
        return protocol.decode(self.socket.recv())

    def collect(self, request_ids: set[str], timeout: float = 30.0, until_tokens: int | None = None):
        """Updates until every request finished (or one has until_tokens tokens): tokens, reasons, errors, batches."""
        tokens: dict[str, list[int]] = {r: [] for r in request_ids}
        reasons: dict[str, str] = {}
        errors: dict[str, protocol.RequestError] = {}
        batches: list[protocol.StepBatch] = []
        deadline = time.monotonic() + timeout
        while set(reasons) | set(errors) != request_ids:
            msg = self.receive(deadline - time.monotonic())
            if isinstance(msg, protocol.RequestError):
                errors[msg.request_id] = msg
                continue
            assert isinstance(msg, protocol.StepBatch)
            batches.append(msg)
            for update in msg.outputs:
                assert update.request_id not in reasons, "an update after the request finished"
                assert update.seq == self.seqs.get(update.request_id, 0), "updates numbered in the order sent"
                self.seqs[update.request_id] = update.seq + 1
                tokens[update.request_id].extend(update.token_ids)
                if update.finish_reason is not None:
                    reasons[update.request_id] = update.finish_reason
            if until_tokens is not None and any(len(t) >= until_tokens for t in tokens.values()):
                break
        return tokens, reasons, errors, batches

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def executor(tiny_models, redis_url, tmp_path_factory):
    proc = ExecutorProcess(tiny_models["llama"], redis_url, tmp_path_factory.mktemp("executor") / "log")
    try:
        proc.wait_registered()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def gateway(executor):
    client = Gateway(executor.address)
    yield client
    client.close()


def test_streams_batched_greedy_tokens_equal_to_the_offline_api(executor, gateway, tiny_models):
    from executor import LLM, SamplingParams

    gateway.generate("a", PROMPT_A, max_tokens=12, temperature=0.0)
    gateway.generate("b", PROMPT_B, max_tokens=12, temperature=0.0, logprobs=2)
    gateway.generate("bad", [1, 2, 10**7], max_tokens=4, temperature=0.0)
    tokens, reasons, errors, batches = gateway.collect({"a", "b", "bad"})

    assert set(errors) == {"bad"} and errors["bad"].code == 400
    assert "token id 10000000 is outside the vocabulary" in errors["bad"].message
    llm = LLM(tiny_models["llama"], kv_cache_memory="8MiB", device="cpu")
    expected = llm.generate([PROMPT_A, PROMPT_B], SamplingParams(max_tokens=12, temperature=0.0))
    assert tokens["a"] == expected[0].outputs[0].token_ids
    assert tokens["b"] == expected[1].outputs[0].token_ids
    assert reasons == {"a": expected[0].outputs[0].finish_reason, "b": expected[1].outputs[0].finish_reason}
    # one message per step for this gateway, holding both requests while both run
    assert any({u.request_id for u in batch.outputs} == {"a", "b"} for batch in batches)
    updates_b = [u for batch in batches for u in batch.outputs if u.request_id == "b"]
    logprobs = [entry for u in updates_b for entry in u.logprobs]
    assert len(logprobs) == len(tokens["b"]) and [e[0] for e in logprobs] == tokens["b"]
    assert all(len(top) == 2 and e[3][0][1] >= e[3][1][1] for e in logprobs for top in [e[3]])
    # what its KV held, on its last update only: 40 prompt tokens + 12 is 4 blocks, for at least 12 steps
    updates_a = [u for batch in batches for u in batch.outputs if u.request_id == "a"]
    assert all(u.kv_block_seconds is None for u in updates_a[:-1]) and updates_a[-1].kv_block_seconds > 0


def test_repeated_prompt_reports_cached_tokens(executor, gateway):
    gateway.generate("a1", PROMPT_A, max_tokens=2, temperature=0.0)
    gateway.collect({"a1"})
    gateway.generate("a2", PROMPT_A, max_tokens=2, temperature=0.0)
    _, reasons, _, batches = gateway.collect({"a2"})
    assert reasons["a2"] == "length"
    assert batches[-1].outputs[-1].num_cached_tokens == 32  # both full prompt blocks


def test_redis_holds_registration_block_hashes_and_load(executor, gateway):
    gateway.generate("r", PROMPT_A, max_tokens=2, temperature=0.0)
    gateway.collect({"r"})
    r = executor.redis
    assert executor.id in r.smembers(keys.EXECUTORS)
    info = r.hgetall(keys.executor_key(executor.id))
    assert info["address"] == executor.address and info["block_size"] == "16"
    assert int(info["kv_blocks_total"]) > 0 and int(info["max_model_len"]) == 1024
    assert float(info["started_at"]) > 0 and info["model"]

    held = r.smembers(keys.blocks_key(executor.id))
    assert {h.hex() for h in hash_blocks(PROMPT_A, 16)} <= held
    assert "stale" not in held  # what an earlier run under this id left was cleared on start
    assert eventually(lambda: r.hget(keys.load_key(executor.id), "running") == "0")
    load = r.hgetall(keys.load_key(executor.id))
    assert load == {
        "running": "0",
        "waiting": "0",
        "compiling": "0",
        "prefill_tokens": "0",
        "kv_usage": "0.0",
        "kv_filled": load["kv_filled"],  # the cached blocks' share: > 0 after a request
        "queue_full": "0",
        "waiting_max_tenant": "0",
        "updated_at": load["updated_at"],
    }
    assert 0 < float(load["kv_filled"]) < 1
    for key in keys.executor_keys(executor.id):
        assert 0 < r.ttl(key) <= keys.HEARTBEAT_TTL_S  # a dead executor's entries expire with it


def test_stats_hash_counts_prefix_cache_hits_and_queue_times(executor, gateway):
    def stats() -> ExecutorStats:
        return ExecutorStats.from_hash(executor.redis.hgetall(keys.stats_key(executor.id)))

    before = stats()
    prompt = list(range(300, 340))  # 40 tokens no other test sends: two full blocks to hit the second time
    for request_id in ("s1", "s2"):
        gateway.generate(request_id, prompt, max_tokens=2, temperature=0.0)
        gateway.collect({request_id})

    def moved(name: str) -> float:
        return stats().counters[name] - before.counters[name]

    # published when the engine goes idle: a finished request shows in /metrics within about a second
    assert eventually(lambda: moved("prefix_cache_hit_tokens") == 32, timeout=1.0)
    assert moved("prefix_cache_queried_tokens") == 80 and moved("preemptions") == 0
    after = stats()
    assert moved("prompt_tokens") == 80 and moved("generation_tokens") == 4
    for name in ("queue_time", "time_to_first_token", "e2e_request_latency"):  # one observation per request
        assert after.histograms[name].buckets[-1] - before.histograms[name].buckets[-1] == 2, name
        assert after.histograms[name].sum - before.histograms[name].sum < 5, name
    total = int(executor.redis.hget(keys.executor_key(executor.id), "kv_blocks_total"))
    pool = {"kv_blocks_used": 0, "kv_blocks_total": total, "running": 0, "waiting": 0}
    no_tiers = {name: 0 for name in after.gauges if name.startswith(("kv_host_", "kv_disk_"))}
    assert no_tiers and after.gauges == {**pool, **no_tiers}  # no tier below the pool is on


def test_block_hashes_that_disagree_with_the_executors_are_counted_and_warned_about_once(executor, gateway):
    def mismatches() -> float:
        stats = ExecutorStats.from_hash(executor.redis.hgetall(keys.stats_key(executor.id)))
        return stats.counters["block_hash_mismatches"]

    def warnings() -> int:
        return executor.log_path.read_text().count("block hashes differ from this executor's")

    prompt = list(range(500, 540))
    before = mismatches()
    gateway.generate("h-agrees", prompt, max_tokens=1, temperature=0.0)  # hashed as the executor hashes
    gateway.collect({"h-agrees"})
    salted = protocol.GenerateRequest(
        "h-salt", prompt, hash_blocks(prompt, 16), {"max_tokens": 1}, Tenant("t", cache_salt="t")
    )
    eight = protocol.GenerateRequest("h-size", prompt, hash_blocks(prompt, 8), {"max_tokens": 1})
    for msg in (salted, eight):  # a gateway that forgot the salt, one with another block size
        gateway.send(msg)
        _, reasons, errors, _ = gateway.collect({msg.request_id})
        assert reasons == {msg.request_id: "length"} and not errors  # served all the same
    assert eventually(lambda: mismatches() - before == 2, timeout=2.0)
    assert warnings() == 1
    gateway.generate("h-agrees-again", prompt, max_tokens=1, temperature=0.0)
    gateway.collect({"h-agrees-again"})
    time.sleep(0.5)  # the stats go out when the engine is idle again
    assert mismatches() - before == 2 and warnings() == 1


def test_abort_stops_a_request(executor, gateway):
    gateway.generate("long", PROMPT_B, max_tokens=500, temperature=0.0, ignore_eos=True)
    tokens, reasons, _, _ = gateway.collect({"long"}, until_tokens=1)
    assert not reasons
    load_key = keys.load_key(executor.id)  # published every step, just after the tokens go out
    assert eventually(lambda: executor.redis.hget(load_key, "running") == "1")
    assert 0 < float(executor.redis.hget(load_key, "kv_usage")) < 1
    gateway.send(protocol.AbortRequest("long"))
    more, reasons, _, batches = gateway.collect({"long"})
    assert reasons == {"long": "abort"}
    assert batches[-1].outputs[-1].kv_block_seconds > 0  # an aborted request still says what its KV held
    assert len(tokens["long"]) + len(more["long"]) < 500
    assert eventually(lambda: executor.redis.hget(load_key, "running") == "0", timeout=0.5)
    assert executor.redis.hget(load_key, "kv_usage") == "0.0"  # its blocks are free again


def test_an_oversized_message_is_refused_and_the_executor_serves_on(executor, gateway):
    """ZeroMQ drops the connection that sends more than MAX_MESSAGE_BYTES before the executor holds it."""
    flooder = Gateway(executor.address)
    bad_before = executor.log_path.read_text().count("bad message")
    try:
        flooder.socket.send(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))
        time.sleep(0.5)
        gateway.generate("after", PROMPT_B, max_tokens=2, temperature=0.0)
        _, reasons, errors, _ = gateway.collect({"after"})
        assert reasons == {"after": "length"} and not errors
        assert executor.process.poll() is None
        # never read whole into memory, so never decoded: the executor had nothing to say of it
        assert executor.log_path.read_text().count("bad message") == bad_before
    finally:
        flooder.close()


def test_bad_input_is_answered_and_the_loop_keeps_serving(executor, gateway):
    gateway.socket.send(b"\xc1 not msgpack")  # no request id to answer: logged and dropped
    gateway.socket.send_multipart([b"two", b"frames"])
    wrong_version = {"v": protocol.PROTOCOL_VERSION + 1, "type": "abort", "request_id": "old"}
    gateway.socket.send(msgpack.packb(wrong_version))
    gateway.send(protocol.GenerateRequest("odd", [1, 2], sampling={"max_tokens": 2, "beam_width": 4}))
    gateway.send(protocol.GenerateRequest("neg", [1, 2], sampling={"max_tokens": -1}))
    gateway.send(protocol.RequestError("x", "executors take no errors", 400))
    gateway.generate("ok", PROMPT_B, max_tokens=3, temperature=0.0)
    _, reasons, errors, _ = gateway.collect({"old", "odd", "neg", "x", "ok"})
    assert reasons == {"ok": "length"}
    assert {r: e.code for r, e in errors.items()} == {"old": 400, "odd": 400, "neg": 400, "x": 400}
    v = protocol.PROTOCOL_VERSION
    assert f"protocol version {v + 1} from peer, this side speaks {v}" in errors["old"].message
    assert "beam_width" in errors["odd"].message and "max_tokens" in errors["neg"].message
    assert executor.process.poll() is None


def test_sigterm_refuses_new_work_finishes_running_and_deregisters(executor):
    """The last test on the module's executor: it drains it."""
    proc, client = executor, Gateway(executor.address)
    try:
        client.generate("running", PROMPT_B, max_tokens=300, temperature=0.0, ignore_eos=True)
        tokens, _, _, _ = client.collect({"running"}, until_tokens=1)
        os.kill(proc.process.pid, signal.SIGTERM)
        assert eventually(lambda: b"draining" in proc.log_path.read_bytes(), timeout=5)
        client.generate("late", PROMPT_A, max_tokens=2, temperature=0.0)
        more, reasons, errors, _ = client.collect({"running", "late"})
        assert errors["late"].code == 503 and errors["late"].message == "executor draining"
        assert reasons == {"running": "length"}
        assert len(tokens["running"]) + len(more["running"]) == 300
        assert proc.process.wait(20) == 0
        assert proc.id not in proc.redis.smembers(keys.EXECUTORS)
        assert not any(proc.redis.exists(k) for k in keys.executor_keys(proc.id))
    finally:
        client.close()


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-00f067aa0ba902b7-01"


def test_traced_requests_leave_spans_in_the_gateways_trace(tiny_models, redis_url, tmp_path, monkeypatch):
    traced = {"t1": TRACE, "t2": TRACE.replace("4", "5"), "t3": TRACE.replace("4", "6")}
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.delenv("KVSERVE_LOG_FORMAT", raising=False)
        ngram = ("--speculative-model", "ngram", "--num-speculative-tokens", "3")
        proc = ExecutorProcess(tiny_models["llama"], redis_url, tmp_path / "log", *ngram)
        client = None
        try:
            proc.wait_registered()
            client = Gateway(proc.address)

            def send(request_id: str, prompt: list[int], tenant: str | None = None, **sampling) -> None:
                sampling = {"temperature": 0.0, "ignore_eos": True, **sampling}
                tp = traceparent(traced[request_id])
                client.send(
                    protocol.GenerateRequest(request_id, prompt, [], sampling, whose(tenant), traceparent=tp)
                )

            send("t1", PROMPT_A, tenant="acme", max_tokens=16)
            client.collect({"t1"})
            spans = receiver.wait_for(lambda spans: len(spans) == 4)
            stats = ExecutorStats.from_hash(proc.redis.hgetall(keys.stats_key(proc.id)))
            send("t2", PROMPT_B, max_tokens=500)
            client.collect({"t2"}, until_tokens=1)
            client.send(protocol.AbortRequest("t2"))
            client.collect({"t2"})
            send("t3", [1, 2, 10**7], max_tokens=2)  # refused: no spans, a log line with its ids
            client.collect({"t3"})
            spans = receiver.wait_for(lambda spans: len(spans) == 8)
        finally:
            if client is not None:
                client.close()
            proc.stop()

    by_trace = {
        request_id: {s["name"]: s for s in spans if s["trace_id"] == t} for request_id, t in traced.items()
    }
    phases = ("executor.queue", "executor.prefill", "executor.decode")
    for request_id in ("t1", "t2"):
        request, *children = (by_trace[request_id][name] for name in ("executor.request", *phases))
        assert request["parent_span_id"] == "00f067aa0ba902b7" and request["service"] == "kvserve-executor"
        assert all(c["parent_span_id"] == request["span_id"] for c in children)
        # the phases tile the request: arrival, first scheduled, first token, end
        bounds = [request["start_ns"], *(c["end_ns"] for c in children)]
        assert [c["start_ns"] for c in children] == bounds[:-1] and bounds[-1] == request["end_ns"]
        assert bounds == sorted(bounds) and bounds[0] < bounds[-1]
    assert not by_trace["t3"]

    spec = {
        "kvserve.spec_decode.draft_tokens": stats.counters["spec_draft_tokens"],
        "kvserve.spec_decode.accepted_tokens": stats.counters["spec_accepted_tokens"],
    }
    assert spec["kvserve.spec_decode.draft_tokens"] > 0  # n-gram lookup finds repeats in this model's output
    spec["kvserve.spec_decode.acceptance_rate"] = (
        stats.counters["spec_accepted_tokens"] / stats.counters["spec_draft_tokens"]
    )
    inputs = {"gen_ai.usage.input_tokens": len(PROMPT_A), "kvserve.cached_tokens": 0}
    inputs |= {f"kvserve.cached_tokens.{source}": 0 for source in ("pool", "host", "disk", "peer")}
    outputs = {"gen_ai.usage.output_tokens": 16, "kvserve.preemptions": 0}
    t1 = by_trace["t1"]
    assert t1["executor.request"]["attributes"] == {
        "kvserve.executor.id": proc.id,
        "kvserve.request.id": "t1",
        "kvserve.tenant": "acme",
        **inputs,
        **outputs,
        **spec,
        "gen_ai.response.finish_reasons": ["length"],
    }
    assert t1["executor.queue"]["attributes"] == {}
    assert t1["executor.prefill"]["attributes"] == inputs
    assert t1["executor.decode"]["attributes"] == {**outputs, **spec}
    t2 = by_trace["t2"]["executor.request"]["attributes"]
    assert t2["gen_ai.response.finish_reasons"] == ["abort"] and "kvserve.tenant" not in t2
    assert 1 <= t2["gen_ai.usage.output_tokens"] < 500

    log_lines = [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]
    refused = [line for line in log_lines if line.get("request_id") == "t3"]
    assert refused and refused[0]["trace_id"] == traced["t3"] and "refused (400)" in refused[0]["message"]
    assert {line["service"] for line in log_lines} == {"kvserve-executor"}


class _NoRedis:
    """Stands in for the IndexWriter where a test is about the loop alone."""

    peer_has_room = True  # as if another executor were idle: a request waiting too long may be handed back
    executor_id = "local"

    def publish(self, *args) -> None:
        pass


@pytest.fixture
def local_service(tiny_models):
    """The service loop in a thread of this process, on a real socket, without Redis: for what a real process
    cannot be made to do on cue."""
    with _local_service(tiny_models["llama"]) as running:
        yield running


@contextlib.contextmanager
def _local_service(model: str, peer_has_room: bool = True, **engine_flags):
    import threading

    from executor.engine import Engine
    from executor.engine_config import EngineConfig
    from executor.service.loop import ExecutorService

    engine = Engine(EngineConfig(model=model, kv_cache_memory="8MiB", device="cpu", **engine_flags))
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    index = _NoRedis()
    index.peer_has_room = peer_has_room
    service = ExecutorService(engine, router, index, grace_s=0.2)
    loop = threading.Thread(target=service.run)
    client = Gateway(address)
    loop.start()
    try:
        yield service, client, loop
    finally:
        if loop.is_alive():
            service.drain()
            service.drain()  # asked twice, it stops at once
            loop.join(5)
        client.close()
        router.close(linger=0)
        context.term()
        engine.close()


def test_grace_period_over_aborts_what_still_runs(local_service):
    service, client, loop = local_service
    client.generate("long", PROMPT_B, max_tokens=900, temperature=0.0, ignore_eos=True)
    tokens, _, _, _ = client.collect({"long"}, until_tokens=1)
    service.drain()
    more, reasons, _, _ = client.collect({"long"})
    assert reasons == {"long": "abort"} and len(tokens["long"]) + len(more["long"]) < 900
    loop.join(5)
    assert not loop.is_alive() and not service.engine.has_unfinished()


def test_a_failing_engine_step_ends_its_requests_with_500_and_the_loop_goes_on(local_service):
    service, client, _ = local_service
    real_step = service.engine.step

    def broken_step():
        service.engine.step = real_step  # fails once
        raise RuntimeError("simulated fault")

    service.engine.step = broken_step
    client.generate("hit", PROMPT_B, max_tokens=3, temperature=0.0)
    _, _, errors, _ = client.collect({"hit"})
    assert errors["hit"].code == 500 and not service.engine.has_unfinished()
    client.generate("after", PROMPT_B, max_tokens=3, temperature=0.0)
    _, reasons, _, _ = client.collect({"after"})
    assert reasons == {"after": "length"}


def test_at_its_queue_bound_the_executor_refuses_new_work_as_busy_before_any_work(tiny_models):
    with _local_service(tiny_models["llama"], max_num_seqs=1, max_waiting_seqs=1) as (service, client, _):
        # "long" holds the one running slot, so "first" waits (tenant A's one place) and A's "second" is refused
        # at once, whichever steps the messages arrive between; tenant B's "other" still finds a place
        client.generate("long", PROMPT_B, "A", max_tokens=900, temperature=0.0, ignore_eos=True)
        client.collect({"long"}, until_tokens=1)
        client.generate("first", PROMPT_B, "A", max_tokens=3, temperature=0.0)
        client.generate("second", PROMPT_B, "A", max_tokens=3, temperature=0.0)
        client.generate("other", PROMPT_B, "B", max_tokens=3, temperature=0.0)
        _, reasons, errors, _ = client.collect({"long", "first", "second", "other"})
        assert reasons == {"long": "length", "first": "length", "other": "length"} and set(errors) == {
            "second"
        }
        assert errors["second"].code == protocol.BUSY and "busy" in errors["second"].message
        assert not service.engine.has_unfinished()
        client.generate("later", PROMPT_B, "A", max_tokens=3, temperature=0.0)  # room again
        _, reasons, _, _ = client.collect({"later"})
        assert reasons == {"later": "length"}


def test_requests_waiting_for_their_grammars_are_bounded_and_a_compile_past_its_deadline_is_a_400(
    tiny_models,
):
    slow = "".join(f"[^{c}]*" for c in "abcdefghijklmnopqrstuvwxyz" * 2)  # seconds to compile
    flags = dict(max_waiting_seqs=1, grammar_compile_timeout=0.5)
    with _local_service(tiny_models["llama"], **flags) as (service, client, _):
        client.generate("slow", PROMPT_B, max_tokens=3, structured_outputs={"regex": slow})
        client.generate("more", PROMPT_B, max_tokens=3, structured_outputs={"regex": "(ab)+"})
        client.generate("plain", PROMPT_B, max_tokens=3, temperature=0.0)
        _, reasons, errors, _ = client.collect({"slow", "more", "plain"}, timeout=120)
        # "slow" holds the one place for requests waiting on a compile, and the waiting queue stays free
        assert errors["more"].code == protocol.BUSY and "wait for their grammars" in errors["more"].message
        assert errors["slow"].code == 400 and errors["slow"].message == (
            "structured_outputs.regex: compiling it took longer than the 0.5 s limit (--grammar-compile-timeout)"
        )
        assert reasons == {"plain": "length"} and not service.engine.has_unfinished()
        client.generate("again", PROMPT_B, max_tokens=3, structured_outputs={"regex": "(ab)+"})
        _, reasons, failed, _ = client.collect({"again"}, timeout=120)
        assert not failed and reasons["again"] in ("stop", "length")
        # the refusal is remembered: asked again, the same 400 at once, with no compile queued
        compiled = service.engine.grammars.num_compiled
        client.generate("slow again", PROMPT_B, max_tokens=3, structured_outputs={"regex": slow})
        _, _, again, _ = client.collect({"slow again"}, timeout=120)
        assert again["slow again"].code == 400 and again["slow again"].message == errors["slow"].message
        assert service.engine.grammars.num_compiled == compiled


def test_a_request_that_waits_too_long_without_starting_is_handed_back_as_busy(tiny_models):
    with _local_service(tiny_models["llama"], max_num_seqs=1, max_waiting_time=0.3) as (service, client, _):
        client.generate("long", PROMPT_B, max_tokens=900, temperature=0.0, ignore_eos=True)
        # before the send: the executor's wait can start before a line after the send runs
        sent = time.monotonic()
        client.generate("behind", PROMPT_B, max_tokens=3, temperature=0.0)
        while not isinstance(msg := client.receive(), protocol.RequestError):
            assert isinstance(msg, protocol.StepBatch)
            assert all(u.request_id == "long" and u.finish_reason is None for u in msg.outputs)
        waited = time.monotonic() - sent
        assert msg.request_id == "behind" and msg.code == protocol.BUSY and "without starting" in msg.message
        assert 0.3 <= waited < 5
        assert set(service.requests.owners) == {"long"}  # the one running stays; nothing of "behind" is left
        client.send(protocol.AbortRequest("long"))


def test_an_executor_without_a_peer_with_room_keeps_a_request_that_waits_long(tiny_models):
    flags = dict(max_num_seqs=1, max_waiting_time=0.3)
    with _local_service(tiny_models["llama"], peer_has_room=False, **flags) as (service, client, _):
        client.generate("long", PROMPT_B, max_tokens=400, temperature=0.0, ignore_eos=True)
        client.generate("behind", PROMPT_B, max_tokens=3, temperature=0.0)
        finished = set()
        while "behind" not in finished:  # handed back, it would come as a busy RequestError instead
            msg = client.receive()
            assert isinstance(msg, protocol.StepBatch)
            finished |= {u.request_id for u in msg.outputs if u.finish_reason is not None}
        assert finished == {"long", "behind"}
