import dataclasses

from executor.kv.tiers.fingerprint import KVFingerprint, model_identity, tier_owner
from shared.tenant import ANONYMOUS_TENANT, Tenant


def test_every_field_changes_the_digest():
    base = KVFingerprint("m", "float32", 4, (2, 2, 4, 2, 8), "auto/int8")
    assert len(base.digest()) == 16 and base.digest() == dataclasses.replace(base).digest()
    changes = dict(
        model="m2",
        dtype="bfloat16",
        block_size=8,
        block_shape=(2, 2, 4, 2, 16),
        quantization="auto/int16",
        adapter="lora",
    )
    digests = {dataclasses.replace(base, **{k: v}).digest() for k, v in changes.items()}
    assert len(digests) == len(changes) and base.digest() not in digests


def test_the_model_identity_follows_the_config_and_the_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "tokenizer.json").write_text("{}")
    first = model_identity(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"changed": 1}')
    assert model_identity(tmp_path) == first  # not a weight: the KV does not depend on it
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    second = model_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 16}')
    assert len({first, second, model_identity(tmp_path)}) == 3


def test_a_tier_owner_is_the_tenant_with_its_salt_digested():
    tenant = Tenant("a", "secret", weight=2.5)
    owner = tier_owner(tenant)
    assert owner.name == "a" and owner.weight == 2.5 and "secret" not in owner.cache_salt
    assert owner == tier_owner(Tenant("a", "secret")) != tier_owner(Tenant("a", "other"))
    assert tier_owner(ANONYMOUS_TENANT) == ANONYMOUS_TENANT
