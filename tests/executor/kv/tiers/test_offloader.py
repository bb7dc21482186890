"""The KV tiers under an engine: blocks the pool lost come back from the host and disk tiers unchanged, counted as
cached, with the same greedy tokens; aborts and random traffic leak no pool block, slot or pin; each tier stays
within its size, and tenants' shares hold there as in the pool."""

from __future__ import annotations

import random

import pytest
import torch

from executor import LLM, SamplingParams
from shared.tenant import Tenant
from tests.kv_blocks import assert_no_blocks_held

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def block_bytes(llm: LLM) -> int:
    kv_cache = llm.engine.runner.kv_cache
    return kv_cache[:, :, 0].numel() * kv_cache.element_size()


def tiny_block_bytes(tiny_models) -> int:
    # tiny llama: 2 layers, K and V, 16 tokens, 2 KV heads of 16 dims, float32
    return 2 * 2 * 16 * 2 * 16 * 4


def prompts(n: int, length: int = 100, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(length)] for _ in range(n)]


def settle(llm: LLM) -> None:
    """Let the tiers' workers finish and be settled (the service does it between steps while idle)."""
    tiers = llm.engine.kv_tiers
    for _ in range(200):
        for future in [job.future for job in tiers._offloads] + [
            load.future for load in tiers._loads.values()
        ]:
            future.exception(timeout=60)  # done, however long a busy machine takes to write a block file
        llm.engine.poll_tiers()
        if not tiers._offloads and not tiers._loads:
            return
    raise AssertionError("the tiers' copies never settled")


def assert_nothing_pinned(llm: LLM) -> None:
    settle(llm)
    tiers = llm.engine.kv_tiers
    assert not tiers._pinned and not tiers._loads and tiers._num_pinned == 0
    for tier in tiers.tiers:
        assert tier.index.num_used_blocks == 0, f"{tier.name} slots still pinned"
        assert tier.index.num_cached_blocks <= tier.index.num_blocks
    assert_no_blocks_held(llm)


@pytest.fixture(scope="module")
def reference(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], kv_cache_memory="1MiB", max_model_len=512, enable_prefix_caching=False)


def test_revisits_come_back_from_the_host_tier_byte_for_byte_with_the_same_tokens(tiny_models, reference):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(tiny_models["llama"], kv_cache_memory=12 * b, kv_offload_memory=64 * b, max_model_len=512)
    assert block_bytes(llm) == b
    pool, kv_cache = llm.engine.kv.pool, llm.engine.runner.kv_cache
    texts = prompts(4)
    first: dict[bytes, torch.Tensor] = {}
    for prompt in texts:
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 0
        for block_hash in pool.cached_hashes():
            first.setdefault(block_hash, kv_cache[:, :, pool.lookup(block_hash).block_id].clone())
        settle(llm)
    for prompt in texts:  # the pool holds 12 blocks: the first prompts' 6 each were evicted long ago
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 96  # 100 tokens: six full blocks, never the last token's
        assert out.outputs[0].token_ids == reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
        for block_hash in pool.cached_hashes():
            if block_hash in first:
                assert torch.equal(kv_cache[:, :, pool.lookup(block_hash).block_id], first[block_hash])
        settle(llm)
    stats = llm.stats()
    assert stats.kv_cached_tokens_host >= 3 * 96 and stats.kv_cached_tokens_pool >= 0
    assert stats.kv_cached_tokens_host + stats.kv_cached_tokens_pool == stats.prefix_cache_hit_tokens
    assert stats.kv_loaded_bytes_host == stats.kv_cached_tokens_host // 16 * b
    assert stats.kv_host_blocks_used == 24 and stats.kv_offloaded_bytes_host == 24 * b
    assert_nothing_pinned(llm)


def test_a_restart_serves_warm_from_the_disk_tier(tiny_models, reference, tmp_path):
    b = tiny_block_bytes(tiny_models)
    texts = prompts(3, seed=1)
    for run in range(2):
        llm = LLM(
            tiny_models["llama"],
            kv_cache_memory=12 * b,
            kv_offload_dir=str(tmp_path / "kv"),
            kv_offload_disk=40 * b,
            max_model_len=512,
        )
        for prompt in texts:
            out = llm.generate([prompt], GREEDY)[0]
            assert out.num_cached_tokens == (96 if run else 0)
            assert out.outputs[0].token_ids == reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert_nothing_pinned(llm)
        assert llm.stats().kv_disk_blocks_used == 18
        llm.engine.close()
    assert llm.stats().kv_cached_tokens_disk == 3 * 96


def test_an_abort_while_loading_and_while_waiting_to_start_leaks_nothing(tiny_models):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(tiny_models["llama"], kv_cache_memory=12 * b, kv_offload_memory=64 * b, max_model_len=512)
    texts = prompts(3, seed=2)
    for prompt in texts:
        llm.generate([prompt], GREEDY)
    settle(llm)
    request_id = llm.add_request(texts[0], GREEDY)  # evicted from the pool: held while it loads
    assert llm.engine.kv_tiers.holds(request_id)
    llm.engine.abort(request_id)
    assert_nothing_pinned(llm)
    request_id = llm.add_request(texts[1], GREEDY)
    settle(llm)  # loaded: in the scheduler's queue, its blocks pinned until it starts
    assert llm.engine.kv_tiers._pinned
    llm.engine.abort(request_id)
    assert_nothing_pinned(llm)
    out = llm.generate([texts[1]], GREEDY)[0]  # and the loaded blocks stayed cached
    assert out.num_cached_tokens == 96


def test_random_traffic_with_both_tiers_leaks_nothing_and_keeps_each_tier_within_its_size(
    tiny_models, reference, tmp_path
):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(
        tiny_models["llama"],
        kv_cache_memory=16 * b,
        kv_offload_memory=20 * b,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_disk=30 * b,
        max_model_len=512,
        max_num_batched_tokens=64,
    )
    rng = random.Random(7)
    heads = prompts(5, length=70, seed=3)
    live: list[str] = []
    expected: dict[str, list[int]] = {}
    for _ in range(40):
        prompt = rng.choice(heads) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 6), temperature=0, n=rng.choice([1, 1, 2]))
        request_id = llm.add_request(prompt, params)
        live.append(request_id)
        expected[request_id] = reference.generate([prompt], params)[0].outputs[0].token_ids
        if rng.random() < 0.2:
            llm.engine.abort(live.pop(rng.randrange(len(live))))
        for _ in range(rng.randrange(0, 4)):
            for out in llm.step():
                if out.finished and out.request_id in expected and out.outputs[0].finish_reason != "abort":
                    assert out.outputs[0].token_ids == expected[out.request_id]
    while llm.engine.has_unfinished():
        llm.step()
    assert_nothing_pinned(llm)
    stats = llm.stats()
    assert stats.kv_cached_tokens_host + stats.kv_cached_tokens_disk > 0
    assert stats.kv_host_blocks_used <= 20 and stats.kv_disk_blocks_used <= 30
    assert len(list((tmp_path / "kv").iterdir())) <= 30


def test_a_tenants_burst_does_not_flush_another_tenants_blocks_from_the_host_tier(tiny_models):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(tiny_models["llama"], kv_cache_memory=12 * b, kv_offload_memory=24 * b, max_model_len=512)
    steady, burst = Tenant("steady", "salt-a"), Tenant("burst", "salt-b")
    kept = prompts(2, seed=4)  # 12 blocks: within half of the tier's 24
    for prompt in kept:
        llm.engine.add_request("k" + str(len(prompt)) + str(prompt[0]), prompt, GREEDY, steady)
        while llm.engine.has_unfinished():
            llm.engine.step()
    settle(llm)
    for i, prompt in enumerate(prompts(8, seed=5)):  # 48 blocks of one-offs
        llm.engine.add_request(f"burst-{i}", prompt, GREEDY, burst)
        while llm.engine.has_unfinished():
            llm.engine.step()
        settle(llm)
    host = llm.engine.kv_tiers.host
    assert host.index.num_cached_blocks == 24
    for i, prompt in enumerate(kept):
        llm.engine.add_request(f"again-{i}", prompt, GREEDY, steady)
        cached = []
        while llm.engine.has_unfinished():
            cached += [o.num_cached_tokens for o in llm.engine.step().outputs]
        assert cached[-1] == 96
    assert_nothing_pinned(llm)


def test_pins_of_loaded_requests_never_keep_the_first_in_line_from_starting(tiny_models, reference):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(tiny_models["llama"], kv_cache_memory=12 * b, kv_offload_memory=64 * b, max_model_len=512)
    revisit, *others = prompts(3, seed=6)
    for prompt in (revisit, *others):
        llm.generate([prompt], GREEDY)
    settle(llm)
    large = prompts(1, length=150, seed=7)[0]  # 10 blocks of the pool's 12
    first = llm.engine.add_request("large", large, GREEDY, Tenant("other", "salt-o"))
    llm.engine.add_request("revisit", revisit, GREEDY)  # its load pins 6 blocks
    settle(llm)
    outputs = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert first[0].finish_reason == "length"
    assert outputs["large"] == reference.generate([large], GREEDY)[0].outputs[0].token_ids
    assert outputs["revisit"] == reference.generate([revisit], GREEDY)[0].outputs[0].token_ids
    assert_nothing_pinned(llm)


def test_a_step_waits_for_copies_down_that_pin_the_blocks_the_next_request_needs(tiny_models, reference):
    """Copies down pin their pool blocks until gathered: on a busy machine the workers may not have got to them
    when the next request needs those blocks, and the step waits for them rather than failing."""
    import threading

    b = tiny_block_bytes(tiny_models)
    llm = LLM(tiny_models["llama"], kv_cache_memory=12 * b, kv_offload_memory=64 * b, max_model_len=512)
    tiers = llm.engine.kv_tiers
    gate = threading.Event()
    stalls = [tiers._pool.submit(gate.wait, 10) for _ in range(2)]  # both workers busy elsewhere
    first, second = prompts(2, seed=8)
    llm.generate([first], GREEDY)  # its six cached blocks stay pinned: no worker has gathered them
    assert tiers.in_flight
    threading.Timer(0.3, gate.set).start()
    out = llm.generate([second], SamplingParams(max_tokens=40, temperature=0))[0]  # 9 blocks: 6 are pinned
    assert (
        out.outputs[0].token_ids
        == reference.generate([second], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].token_ids
    )
    assert all(s.done() for s in stalls)
    assert_nothing_pinned(llm)


def test_reuse_admission_keeps_one_off_prompts_out_of_the_host_tier_and_admits_a_second_use(
    tiny_models, reference
):
    b = tiny_block_bytes(tiny_models)
    llm = LLM(
        tiny_models["llama"],
        kv_cache_memory=12 * b,
        kv_offload_memory=64 * b,
        kv_offload_admission="reuse",
        max_model_len=512,
    )
    served_twice, *one_offs = prompts(5, seed=2)
    assert llm.generate([served_twice], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([served_twice], GREEDY)[0].num_cached_tokens == 96  # a hit in the pool: admitted
    settle(llm)
    assert llm.stats().kv_host_blocks_used == 6
    for prompt in one_offs:  # each computed once: never offered, while they evict served_twice from the pool
        assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
        settle(llm)
    assert llm.stats().kv_host_blocks_used == 6
    out = llm.generate([served_twice], GREEDY)[0]
    stats = (
        llm.stats()
    )  # the pool keeps what was used twice longer than the one-offs: some of it is still there
    assert out.num_cached_tokens == 96 and stats.kv_cached_tokens_host > 0
    assert stats.kv_cached_tokens_host + stats.kv_cached_tokens_pool == 96 + 96
    assert out.outputs[0].token_ids == reference.generate([served_twice], GREEDY)[0].outputs[0].token_ids
    settle(llm)
    again = one_offs[0]  # computed a second time after the pool lost it: admitted now, found next time
    assert llm.generate([again], GREEDY)[0].num_cached_tokens == 0
    settle(llm)
    assert llm.stats().kv_host_blocks_used == 12
    for prompt in one_offs[1:]:
        llm.generate([prompt], GREEDY)
        settle(llm)
    assert llm.generate([again], GREEDY)[0].num_cached_tokens == 96
    assert_nothing_pinned(llm)


def test_reuse_admission_remembers_a_bounded_number_of_first_appearances():
    from executor.kv.tiers.admission import ReuseAdmission

    admission = ReuseAdmission(num_remembered=2)
    assert admission.admit([b"a", b"b", b"c"]) == []  # a is forgotten: only two first appearances kept
    assert admission.admit([b"b", b"c"]) == [b"b", b"c"]  # a second appearance, admitted and forgotten
    assert admission.admit([b"a"]) == []  # a first appearance again
    assert admission.admit([b"a"]) == [b"a"]
    with pytest.raises(ValueError, match="at least one"):
        ReuseAdmission(0)
