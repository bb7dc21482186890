"""Peer pulls between two engines: a request whose prefix another executor holds gets it over ZeroMQ, counted as
cached, with the same greedy tokens; a peer that is dead, stalls or fails part-way leaves the request computed
(what arrived in order kept) and correct, and nothing pinned on either side."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from executor import LLM, SamplingParams
from executor.kv.tiers.peer_puller import KVPuller
from executor.kv.tiers.peer_transfer_server import KVTransferServer
from shared.block_hash import hash_blocks
from shared.protocol import KVPeer
from tests.executor.kv.tiers.test_offloader import assert_nothing_pinned, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0)


class EngineThread:
    """The holder's engine thread, as its service loop is between steps: it serves the peers' pin requests."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.stop = llm, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.llm.engine.poll_tiers()
            time.sleep(0.002)

    def __enter__(self) -> EngineThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class FailingSource:
    """A block source whose leases fail to read block `fail_at` on, or stall on it for `stall_s`."""

    def __init__(self, source, fail_at: int, stall_s: float = 0.0) -> None:
        self.source, self.fail_at, self.stall_s = source, fail_at, stall_s

    def open(self, hashes, timeout_s):
        lease = self.source.open(hashes, timeout_s)
        outer = self

        class Lease:
            def __init__(self) -> None:
                self.hashes = lease.hashes

            def read(self, i):
                if i >= outer.fail_at:
                    if outer.stall_s:
                        time.sleep(outer.stall_s)
                    raise OSError("the peer's disk went away")
                return lease.read(i)

            def close(self) -> None:
                lease.close()

        return Lease()


@pytest.fixture(scope="module")
def pair(tiny_models):
    holder = LLM(tiny_models["llama"], kv_cache_memory="1MiB", max_model_len=512)
    puller = LLM(tiny_models["llama"], kv_cache_memory="1MiB", max_model_len=512, kv_pull_timeout=1.0)
    reference = LLM(
        tiny_models["llama"], kv_cache_memory="1MiB", max_model_len=512, enable_prefix_caching=False
    )
    tiers = puller.engine.kv_tiers
    tiers.puller = KVPuller(tiers.copies.kv_cache[:, :, 0].shape, tiers.copies.kv_cache.dtype, None)
    yield holder, puller, reference
    tiers.puller.close()


def run(llm: LLM, request_id: str, prompt: list[int], peer: KVPeer | None) -> tuple[list[int], int]:
    llm.engine.add_request(request_id, prompt, GREEDY, kv_peer=peer)
    tokens, cached = [], 0
    while llm.engine.has_unfinished():
        for out in llm.engine.step().outputs:
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def serve(holder: LLM, source=None) -> KVTransferServer:
    tiers = holder.engine.kv_tiers
    server = KVTransferServer(
        "tcp://127.0.0.1:0", tiers.fingerprint.digest(), source or tiers.block_source(), None
    )
    server.start()
    return server


def test_a_prefix_pulled_from_a_peer_is_cached_and_answers_the_same(pair):
    holder, puller, reference = pair
    prompt = prompts(1, seed=11)[0]
    holder.generate([prompt], GREEDY)
    server = serve(holder)
    try:
        with EngineThread(holder):
            tokens, cached = run(puller, "pulled", prompt, KVPeer("holder", server.address, 6))
    finally:
        server.close()
    assert cached == 96
    assert tokens == reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stats = puller.stats()
    assert stats.kv_cached_tokens_peer == 96 and stats.kv_pulls == 1 and stats.kv_pulls_failed == 0
    assert stats.kv_pulled_bytes == 6 * puller.engine.kv_tiers.block_bytes
    assert_nothing_pinned(puller)
    holder.engine.poll_tiers()
    assert_nothing_pinned(holder)


@pytest.mark.parametrize("how", ["dead", "stalls", "fails part-way"])
def test_a_pull_that_fails_leaves_the_request_computed_and_correct(pair, how):
    holder, puller, reference = pair
    prompt = prompts(1, seed=12 + len(how))[0]
    holder.generate([prompt], GREEDY)
    source = holder.engine.kv_tiers.block_source()
    server = serve(
        holder, FailingSource(source, fail_at=0 if how == "stalls" else 2, stall_s=3.0 * (how == "stalls"))
    )
    address = server.address
    if how == "dead":
        server.close()
    failed_before = puller.stats().kv_pulls_failed
    started = time.monotonic()
    try:
        with EngineThread(holder):
            tokens, cached = run(puller, f"failing-{how}", prompt, KVPeer("holder", address, 6))
    finally:
        server.close()
    assert time.monotonic() - started < 1.0 + 2.5  # the pull's deadline, then the compute
    assert cached == (32 if how == "fails part-way" else 0)
    assert tokens == reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert puller.stats().kv_pulls_failed == failed_before + 1
    assert_nothing_pinned(puller)
    holder.engine.poll_tiers()
    time.sleep(0.1)
    holder.engine.poll_tiers()
    assert_nothing_pinned(holder)


def test_a_lease_never_serves_a_block_handed_out_again_after_it_opened(pair):
    """Leases pin nothing (the engine thread may be in a step): a block evicted and handed out again since the
    lease found it fails its read, so a pull never gets another prompt's KV under this one's hash."""
    holder, _, _ = pair
    prompt = prompts(1, seed=21)[0]
    holder.generate([prompt], GREEDY)
    engine = holder.engine
    hashes = hash_blocks(prompt, engine.block_size)[: (len(prompt) - 1) // engine.block_size]
    lease = engine.kv_tiers.block_source().open(hashes, 1.0)
    assert lease.hashes == hashes
    assert torch.equal(lease.read(0), engine.runner.kv_cache[:, :, engine.kv.pool.lookup(hashes[0]).block_id])
    pool = engine.kv.pool
    taken = pool.allocate(pool.num_free_blocks)  # every cached block evicted and handed out
    try:
        with pytest.raises(LookupError, match="evicted"):
            lease.read(0)
    finally:
        pool.free(taken)
    assert engine.kv_tiers.block_source().open(hashes, 1.0).hashes == []
