from executor.block_pool import BlockPool
from executor.kv_cache_manager import KVCacheManager
from executor.request import Request, RequestStatus
from executor.scheduler import Scheduler
from shared.sampling_params import SamplingParams

MAX_MODEL_LEN = 1024


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, caching=True):
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size)
    return Scheduler(kv, max_num_seqs, budget, MAX_MODEL_LEN, chunked)


def request(rid, n, first=0, max_tokens=8, eos=frozenset()):
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), eos)


def run_step(sched, sample=lambda request: [7]):
    """One step with a stand-in for the model: the requests whose every token has KV after it get sample()'s
    tokens (one, or accepted proposals and one more)."""
    out = sched.schedule()
    done = [r for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens]
    sched.update_from_output(out, done, [sample(r) for r in done])
    return out


def test_budget_is_shared_decodes_first_then_prefill_chunks():
    sched = make(budget=10)
    a = request("a", 3)
    sched.add(a)
    run_step(sched)  # a's prompt done; a now decodes
    b = request("b", 25, first=100)
    sched.add(b)
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 7)]
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(budget=10, chunked=False)
    sched.add(request("a", 8))
    sched.add(request("b", 8, first=50))
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 8)]
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 8)]


def test_max_num_seqs_caps_the_running_set_and_fcfs_admits_in_order():
    sched = make(max_num_seqs=2, budget=100)
    for rid in "abc":
        sched.add(request(rid, 4, first=ord(rid) * 10))
    out = run_step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, block_size=4, budget=100)
    a, b = request("a", 7), request("b", 7, first=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # prompts: 2 blocks each, the pool is full
    run_step(sched)  # decode into slot 7: still the second block
    out = run_step(sched)  # slot 8 needs a third block each: the newest (b) makes room
    assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]
    assert b.status is RequestStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and sched.num_preemptions == 1
    # its full blocks stay in the prefix cache: readmission recomputes only the tail
    assert len(sched.kv.find_cached_prefix(b)) == 1


def test_preempted_request_is_readmitted_before_newer_arrivals():
    sched = make(num_blocks=4, block_size=4, budget=100)
    a, b = request("a", 7), request("b", 7, first=50)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        run_step(sched)
    c = request("c", 3, first=90)
    sched.add(c)
    sched.finish(a, "abort")
    out = run_step(sched)
    assert [r.request_id for r, _ in out.scheduled][0] == "b"


def test_removing_requests_frees_every_block():
    sched = make(num_blocks=16)
    reqs = [request(str(i), 9, first=i * 20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_step(sched)
    for r in reqs:
        sched.finish(r, "abort")
    assert sched.kv.pool.num_free_blocks == 16 and not sched.running and not sched.waiting
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason == "abort" for r in reqs)


def test_the_waiting_queue_is_full_at_its_bound_of_requests_or_tokens_to_prefill():
    kv = KVCacheManager(BlockPool(64, True), 4)
    by_count = Scheduler(kv, 1, 32, MAX_MODEL_LEN, max_waiting_seqs=2)
    by_count.add(request("a", 3))
    by_count.add(request("b", 3))
    assert by_count.queue_full
    run_step(by_count)  # a starts: one waits
    assert not by_count.queue_full
    by_tokens = Scheduler(KVCacheManager(BlockPool(64, True), 4), 1, 32, MAX_MODEL_LEN, max_waiting_tokens=20)
    assert not by_tokens.queue_full  # an empty queue is never full, whatever the bound
    by_tokens.add(request("a", 3))
    by_tokens.add(request("b", 12))
    assert not by_tokens.queue_full
    by_tokens.add(request("c", 5, first=40))
    assert by_tokens.queue_full  # 20 prompt tokens wait to be prefilled
    unbounded = make(max_num_seqs=1)  # the offline API queues whatever it is given
    for i in range(50):
        unbounded.add(request(f"r{i}", 3))
    assert not unbounded.queue_full


def test_unstarted_since_lists_only_requests_never_scheduled():
    sched = make(max_num_seqs=1)
    a, b = request("a", 3), request("b", 3)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # the engine stamps what a step scheduled first
    a.first_scheduled_ns = 1
    assert sched.unstarted_since(b.queued_ns + 1) == [b]
    assert sched.unstarted_since(b.queued_ns) == []  # queued too recently


def test_a_cached_prefix_counts_as_computed_and_only_the_rest_is_scheduled():
    sched = make(block_size=4, budget=100)
    a = request("a", 10)
    sched.add(a)
    run_step(sched)
    sched.finish(a, "abort")  # its two full blocks stay cached
    b = request("b", 10)
    sched.add(b)
    out = run_step(sched)
    assert out.scheduled == [(b, 2)] and b.num_cached_tokens == 8
    assert b.num_computed_tokens == 10 and b.num_output_tokens == 1
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (20, 8)


def test_update_rolls_back_rejected_proposals_and_publishes_only_verified_blocks():
    sched = make(block_size=4, budget=100)
    a = request("a", 7)
    sched.add(a)
    run_step(sched)  # 7 prompt tokens computed, one sampled: 8 tokens
    a.set_spec_tokens([1, 2, 3, 4])
    out = sched.schedule()
    assert out.scheduled == [(a, 5)]  # the newest token and four proposals, verified in one step
    (new,) = sched.update_from_output(out, [a], [[9]])  # none accepted: the target's own token instead
    assert (new.num_proposed, new.num_accepted, new.token_ids) == (4, 0, [9])
    assert a.token_ids[7:] == [7, 9] and a.num_computed_tokens == 8 and not a.spec_token_ids
    assert (sched.spec_draft_tokens, sched.spec_accepted_tokens) == (4, 0)
    # two blocks hold verified tokens only; the rejected proposals' block is not published
    probe = Request("b", a.token_ids[:8] + [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert len(sched.kv.find_cached_prefix(probe)) == 2


def test_a_stop_inside_an_accepted_run_cuts_it_and_frees_the_request():
    sched = make(block_size=4, budget=100)
    a = request("a", 6, eos=frozenset({5}))
    sched.add(a)
    run_step(sched)
    a.set_spec_tokens([1, 5, 3])
    out = sched.schedule()
    (new,) = sched.update_from_output(out, [a], [[1, 5, 3, 4]])  # all accepted, but 5 ends it
    assert new.token_ids == [1, 5] and a.finish_reason == "stop" and a.status is RequestStatus.FINISHED
    assert not sched.running and sched.kv.pool.num_free_blocks == 64
    assert a.num_computed_tokens == a.num_tokens - 1


def test_max_tokens_finishes_a_request_with_length():
    sched = make()
    a = request("a", 3, max_tokens=2)
    sched.add(a)
    run_step(sched)
    assert a.finish_reason is None
    run_step(sched)
    assert a.finish_reason == "length" and a.output_token_ids == [7, 7] and not sched.running
