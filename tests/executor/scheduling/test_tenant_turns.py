"""Tenants take turns: the one served least recently goes next, first come first served within a tenant."""

from __future__ import annotations

import pytest

from executor.scheduling.tenant_turns import TenantTurns


def drain(turns: TenantTurns) -> list:
    return [turns.pop() for _ in range(len(turns))]


def test_one_tenants_burst_waits_behind_itself():
    turns = TenantTurns()
    for i in range(4):
        turns.push("alpha", f"a{i}")
    turns.push("beta", "b0")
    turns.push(None, "n0")  # anonymous requests are a tenant like any other
    turns.push("beta", "b1")
    assert drain(turns) == ["a0", "b0", "n0", "a1", "b1", "a2", "a3"]


def test_a_tenant_arriving_late_goes_before_one_served_a_moment_ago():
    turns = TenantTurns()
    turns.push("alpha", "a0")
    turns.push("alpha", "a1")
    assert turns.pop() == "a0"
    turns.push("beta", "b0")  # while a0 runs: beta has not had a turn, alpha just had one
    assert drain(turns) == ["b0", "a1"]
    turns.push("alpha", "a2")
    turns.push("beta", "b1")  # queued after alpha's, but beta's last turn (b0) came before alpha's (a1)
    assert drain(turns) == ["b1", "a2"]


def test_remove_takes_back_a_queued_item_and_clear_empties():
    turns = TenantTurns()
    turns.push("alpha", "a0")
    turns.push("alpha", "a1")
    turns.push("beta", "b0")
    assert turns.remove("alpha", "a0") and not turns.remove("alpha", "a0") and not turns.remove("gamma", "x")
    assert len(turns) == 2
    assert turns.remove("beta", "b0") and drain(turns) == ["a1"]
    turns.push("beta", "b1")
    assert turns.clear() == ["b1"] and len(turns) == 0
    with pytest.raises(IndexError):
        turns.pop()
