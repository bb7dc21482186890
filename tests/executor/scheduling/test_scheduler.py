from executor.kv.block_pool import BlockPool
from executor.kv.cache_manager import KVCacheManager
from executor.request import Request, RequestStatus
from executor.scheduling.scheduler import Scheduler
from shared.sampling_params import SamplingParams
from shared.tenant import ANONYMOUS_TENANT, Tenant

MAX_MODEL_LEN = 1024


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, caching=True, fair_share=True):
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size)
    return Scheduler(kv, max_num_seqs, budget, MAX_MODEL_LEN, chunked, fair_share=fair_share)


def request(rid, n, first=0, max_tokens=8, eos=frozenset(), tenant=None, weight=1.0, priority=0):
    """tenant: its name (None: the anonymous tenant)."""
    params = SamplingParams(max_tokens=max_tokens)
    whose = ANONYMOUS_TENANT if tenant is None else Tenant(tenant, weight=weight)
    return Request(rid, list(range(first, first + n)), params, eos, tenant=whose, priority=priority)


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
    assert b.status is RequestStatus.WAITING and next(iter(sched.waiting)) is b
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
    """With fair share off, one bound for all: today's single-queue back-pressure, whoever sends."""
    kv = KVCacheManager(BlockPool(64, True), 4)
    by_count = Scheduler(kv, 1, 32, MAX_MODEL_LEN, max_waiting_seqs=2, fair_share=False)
    by_count.add(request("a", 3, tenant="A"))
    by_count.add(request("b", 3, tenant="A"))
    # one tenant's burst takes every place
    assert by_count.queue_full and by_count.queue_full_for(Tenant("B"))
    run_step(by_count)  # a starts: one waits
    assert not by_count.queue_full and not by_count.queue_full_for(Tenant("A"))
    kv = KVCacheManager(BlockPool(64, True), 4)
    by_tokens = Scheduler(kv, 1, 32, MAX_MODEL_LEN, max_waiting_tokens=20, fair_share=False)
    assert not by_tokens.queue_full  # an empty queue is never full, whatever the bound
    by_tokens.add(request("a", 3))
    by_tokens.add(request("b", 12))
    assert not by_tokens.queue_full
    by_tokens.add(request("c", 5, first=40))
    assert by_tokens.queue_full  # 20 prompt tokens wait to be prefilled
    unbounded = make(max_num_seqs=1)  # the offline API queues whatever it is given
    for i in range(50):
        unbounded.add(request(f"r{i}", 3))
    assert not unbounded.queue_full and not unbounded.queue_full_for(ANONYMOUS_TENANT)


def test_each_tenant_has_its_own_waiting_places_and_all_together_four_times_that():
    kv = KVCacheManager(BlockPool(64, True), 4)
    sched = Scheduler(kv, 1, 32, MAX_MODEL_LEN, max_waiting_seqs=2)
    sched.add(request("a1", 3, tenant="A"))
    sched.add(request("a2", 3, tenant="A"))
    assert sched.queue_full_for(Tenant("A"))  # A's burst fills A's places...
    assert not sched.queue_full_for(Tenant("B")) and not sched.queue_full  # ...and B still finds one
    for tenant in "BCD":
        for i in range(2):
            sched.add(request(f"{tenant}{i}", 3, tenant=tenant))
    assert sched.queue_full and sched.queue_full_for(Tenant("E"))  # 4 x 2 places, all taken
    assert sched.waiting.max_per_tenant == 2
    run_step(sched)  # a1 starts: a place is free again, for anyone
    assert (
        not sched.queue_full
        and not sched.queue_full_for(Tenant("E"))
        and not sched.queue_full_for(Tenant("A"))
    )
    kv = KVCacheManager(BlockPool(64, True), 4)
    by_tokens = Scheduler(kv, 1, 32, MAX_MODEL_LEN, max_waiting_tokens=20)
    by_tokens.add(request("a", 20, tenant="A"))
    assert by_tokens.queue_full_for(Tenant("A")) and not by_tokens.queue_full_for(ANONYMOUS_TENANT)


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


# -- fair share between tenants -------------------------------------------------------------------


def burst_then_one(fair_share: bool) -> tuple[Scheduler, Request]:
    """Tenant A's 16 long prompts, one step of them, then tenant B's short one."""
    sched = make(num_blocks=512, max_num_seqs=32, budget=32, fair_share=fair_share)
    for i in range(16):
        sched.add(request(f"a{i}", 64, first=1000 * i, max_tokens=4, tenant="A"))
    run_step(sched)
    b = request("b", 8, first=99_000, max_tokens=4, tenant="B")
    sched.add(b)
    return sched, b


def test_a_burst_waits_behind_itself_and_another_tenants_prompt_starts_at_the_next_step():
    sched, b = burst_then_one(fair_share=True)
    out = run_step(sched)
    assert (b, 8) in out.scheduled and out.num_tokens == 32  # B's whole prompt, A the rest of the budget
    assert b.num_output_tokens == 1

    sched, b = burst_then_one(
        fair_share=False
    )  # one first-come-first-served line: B waits for A's 1024 tokens
    steps = 1
    while (b, 8) not in run_step(sched).scheduled:
        steps += 1
    assert steps > 16 * 64 // 32


def test_backlogged_tenants_get_prefill_tokens_in_proportion_to_their_weights():
    sched = make(num_blocks=1024, max_num_seqs=64, budget=30)
    for i in range(30):  # more than either gets through: both stay backlogged
        sched.add(request(f"a{i}", 40, first=1000 * i, max_tokens=1, tenant="A", weight=2.0))
        sched.add(request(f"b{i}", 40, first=1000 * i + 500, max_tokens=1, tenant="B"))
    given = {"A": 0, "B": 0}
    for _ in range(40):
        for r, n in run_step(sched).scheduled:
            given[r.tenant.name] += n
    assert given["A"] + given["B"] == 40 * 30
    assert abs(given["A"] - 2 * given["B"]) <= 2 * 30  # within a chunk or so of 2:1 (800:400)


def test_priority_orders_requests_within_a_tenant_and_across_all_without_fair_share():
    for fair_share in (True, False):
        sched = make(max_num_seqs=1, fair_share=fair_share)
        sched.add(request("late", 3, priority=1))
        sched.add(request("first", 3, first=10))
        sched.add(request("urgent", 3, first=20, priority=-5))
        sched.add(request("second", 3, first=30))
        assert [r.request_id for r in sched.waiting] == ["urgent", "first", "second", "late"]
    sched = make(max_num_seqs=1, fair_share=False)
    sched.add(request("a", 3, tenant="A"))
    sched.add(request("b", 3, first=10, tenant="B", priority=-1))
    assert [r.request_id for r in sched.waiting] == ["b", "a"]  # one line for all: priority, then arrival


def test_a_preempted_request_goes_back_first_in_its_own_tenants_line():
    sched = make(num_blocks=4, block_size=4, budget=100)
    a, b = request("a", 7, tenant="A"), request("b", 7, first=50, tenant="B")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # prompts: 2 blocks each, the pool is full
    b2, a2 = request("b2", 3, first=80, tenant="B"), request("a2", 3, first=90, tenant="A")
    sched.add(b2)
    sched.add(a2)
    run_step(sched)  # no block for b2 or a2: they wait
    out = run_step(sched)  # a's slot 8 needs a third block: the newest, b, makes room
    assert out.preempted == [b]
    assert sched.waiting.first(Tenant("B")) is b and [r.request_id for r in sched.waiting] == [
        "b",
        "b2",
        "a2",
    ]


def test_with_one_tenant_or_without_fair_share_the_schedule_is_first_come_first_served():
    """The same mixed workload (prefix hits, chunked prompts, preemptions, proposals to verify) gives the same
    schedule with fair share off as with every request one tenant's; with tenants apart it does not."""

    def run(fair_share: bool, tenants: str) -> list[list[tuple[str, int]]]:
        sched = make(num_blocks=14, block_size=4, max_num_seqs=6, budget=24, fair_share=fair_share)
        schedule = []
        for step in range(60):
            if step < 12:
                tenant = tenants[step % len(tenants)]
                n = 6 + (step * 7) % 23
                sched.add(
                    request(f"r{step}", n, first=(step % 3) * 5, max_tokens=3 + step % 5, tenant=tenant)
                )
            for r in sched.running:
                if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens % 2:
                    r.set_spec_tokens([7, 8])
            out = run_step(sched, sample=lambda r: [7] * (1 + len(r.spec_token_ids) // 2))
            schedule.append([(r.request_id, n) for r, n in out.scheduled])
        assert not sched.num_unfinished  # it all ran
        # and it ran out of blocks (tenants apart, KV shares may keep a tenant past its share waiting instead)
        assert sched.num_preemptions or (fair_share and len(tenants) > 1)
        return schedule

    fcfs = run(fair_share=False, tenants="ABC")
    assert run(fair_share=True, tenants="A") == fcfs
    assert run(fair_share=False, tenants="A") == fcfs
    assert run(fair_share=True, tenants="ABC") != fcfs


def test_blocks_for_a_tenants_growth_come_from_the_tenant_holding_the_most_first():
    sched = make(num_blocks=6, block_size=4, budget=100)
    a1, a2 = request("a1", 7, tenant="A"), request("a2", 3, first=20, tenant="A")
    sched.add(a1)
    sched.add(a2)
    run_step(sched)  # A holds 3 blocks
    b = request("b", 7, first=50, tenant="B")
    sched.add(b)
    run_step(sched)  # B's prompt (7 tokens, 2 blocks), the newest request; A's two decodes
    out = run_step(
        sched
    )  # b's slot 8 needs a block, the last free one goes to a2's slot 4: someone must make room
    assert b not in out.preempted and out.preempted[0].tenant.name == "A"
    assert [r.request_id for r, _ in out.scheduled if r.tenant.name == "B"] == ["b"]


def test_a_request_whose_adapter_finds_no_slot_lets_the_ones_behind_it_start():
    """max_loras=1 with adapter x running: y's request waits, while the base model's and x's behind it start in
    the same step (admission does not stop at y); y starts once no request of x runs."""
    from executor.lora.adapter_files import LoRAAdapter

    kv = KVCacheManager(BlockPool(64, True), 4)
    sched = Scheduler(kv, 8, 100, MAX_MODEL_LEN, True, max_loras=1)

    def under(adapter: str, r: Request) -> Request:
        r.adapter = LoRAAdapter(adapter, f"/adapters/{adapter}", 8, adapter * 8, ("q_proj",))
        return r

    a = under("x", request("a", 4, max_tokens=3))
    sched.add(a)
    run_step(sched)
    b, c, d = (
        under("y", request("b", 4, first=50)),
        request("c", 4, first=100),
        under("x", request("d", 4, first=150, max_tokens=2)),
    )
    for r in (b, c, d):
        sched.add(r)
    out = run_step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["a", "c", "d"]
    assert list(sched.waiting) == [b]
    while b.status is RequestStatus.WAITING:
        out = run_step(sched)
    assert a.status is d.status is RequestStatus.FINISHED
    assert not any(r.adapter is not None and r.adapter.name == "x" for r in sched.running)
