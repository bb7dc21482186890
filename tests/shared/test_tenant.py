from __future__ import annotations

from shared.tenant import ANONYMOUS_TENANT, Tenant


def test_a_tenant_is_its_name_and_salt_whatever_weight_its_key_gives():
    assert Tenant("acme", "salt", 1.0) == Tenant("acme", "salt", 4.0)  # two keys of one tenant
    assert len({Tenant("acme", "salt", 1.0), Tenant("acme", "salt", 4.0)}) == 1
    assert Tenant("acme", "salt") != Tenant("acme", "other salt")


def test_a_keys_tenant_named_anonymous_is_not_the_anonymous_tenant():
    assert Tenant("anonymous", "salt") != ANONYMOUS_TENANT
    assert Tenant("anonymous") == ANONYMOUS_TENANT and ANONYMOUS_TENANT.cache_salt is None
