from executor.scheduling.fair_share import CACHED_TOKEN_COST, VirtualTokenCounter, service


def test_service_counts_computed_tokens_whole_and_cached_ones_at_a_discount():
    assert service(10) == 10
    assert service(2, cached=40) == 2 + 40 * CACHED_TOKEN_COST
    assert 0 < CACHED_TOKEN_COST < 1


def test_a_counter_grows_by_the_tokens_divided_by_the_weight():
    vtc = VirtualTokenCounter()
    vtc.join("a")
    vtc.join("b")
    vtc.charge("a", 2.0, 100)
    vtc.charge("b", 1.0, 100)
    assert (vtc.of("a"), vtc.of("b")) == (50, 100)
    vtc.charge("b", 1.0, -40)  # service charged, then not given (its request was preempted)
    assert vtc.of("b") == 60


def test_a_tenant_that_comes_back_from_idle_is_lifted_to_the_lowest_counter_of_those_with_work():
    vtc = VirtualTokenCounter()
    for tenant in "abc":
        vtc.join(tenant)
    vtc.charge("a", 1.0, 10)
    vtc.leave("a")  # idle at 10
    vtc.charge("b", 1.0, 500)
    vtc.charge("c", 1.0, 300)
    vtc.join("a")  # idle time banks no credit: from 10 up to the lowest counter with work, c's 300
    assert vtc.of("a") == 300 and "a" in vtc
    vtc.join("new")  # never seen: the same floor
    assert vtc.of("new") == 300


def test_going_idle_does_not_wipe_a_debt():
    vtc = VirtualTokenCounter()
    vtc.join("a")
    vtc.join("b")
    vtc.charge("a", 1.0, 1000)
    vtc.leave("a")
    vtc.join("a")
    assert vtc.of("a") == 1000 and vtc.of("b") == 0


def test_a_tenant_has_work_until_its_last_request_leaves():
    vtc = VirtualTokenCounter()
    vtc.join("a")
    vtc.join("a")
    vtc.leave("a")
    assert "a" in vtc
    vtc.leave("a")
    assert "a" not in vtc


def test_when_no_tenant_has_work_the_last_to_leave_sets_the_floor():
    vtc = VirtualTokenCounter()
    vtc.join("a")
    vtc.join(None)  # the anonymous tenant is a tenant like any other
    vtc.charge("a", 1.0, 70)
    vtc.charge(None, 1.0, 90)
    vtc.leave("a")
    vtc.leave(None)
    vtc.join("b")
    assert vtc.of("b") == 90


def test_idle_tenants_are_remembered_up_to_a_bound_and_a_forgotten_one_is_lifted_as_new():
    vtc = VirtualTokenCounter(remembered=2)
    vtc.join("busy")
    for tenant in ("x", "y", "z"):
        vtc.join(tenant)
        vtc.charge(tenant, 1.0, 1000)
        vtc.leave(tenant)
    vtc.join("x")  # the longest idle, forgotten
    vtc.join("y")
    assert vtc.of("x") == 0 and vtc.of("y") == 1000
