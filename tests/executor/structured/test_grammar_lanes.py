"""The two compile lanes and the remembered refusals, with real compile processes: a plain schema is compiled in
the fast lane while the slow lane is busy with another tenant's long compile, and a spec refused once (past the
deadline, or invalid) is refused again at once, without a compile and without killing a process."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from executor.structured.grammars import Grammars
from shared.structured_outputs import StructuredOutputsParams
from shared.tenant import Tenant
from tests.executor.structured.test_grammars import slow_regex
from tests.processes import eventually

OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def pattern_schema(classes: int, first_letter: int = 0) -> dict:
    """A string property whose pattern is `classes` overlapping classes: its compile grows with their square."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    pattern = "".join(f"[^{letters[(first_letter + i) % 26]}]*" for i in range(classes))
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{pattern}$"}}}


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def grammars_for(tokenizer, timeout_s: float, **options) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), timeout_s, **options)


def test_a_plain_schema_compiles_while_another_tenants_long_compiles_run(tokenizer):
    grammars = grammars_for(tokenizer, timeout_s=120)
    try:
        flood = [
            grammars.compile(StructuredOutputsParams(json=pattern_schema(80, i)), Tenant("flood", "f"))
            for i in range(3)
        ]
        # the first is past the fast budget and compiling in the slow lane (for tens of seconds)
        assert eventually(lambda: grammars.num_slow >= 1, timeout=60)
        plain = grammars.compile(StructuredOutputsParams(json=OK_SCHEMA), Tenant("plain", "p"))
        assert plain.result(timeout=60) is not None
        assert not flood[0].done()  # it did not wait for the long compile
        assert grammars.lookup(StructuredOutputsParams(json=OK_SCHEMA), Tenant("plain", "p")) is plain
    finally:
        grammars.close()
    assert all(future.done() for future in flood)


def test_a_spec_refused_past_its_deadline_is_refused_again_at_once_without_a_compile(tokenizer):
    grammars = grammars_for(tokenizer, timeout_s=1.0, fast_budget_s=0.2)
    tenant, spec = Tenant("alpha", "salt-a"), StructuredOutputsParams(regex=slow_regex())
    message = (
        "structured_outputs.regex: compiling it took longer than the 1 s limit (--grammar-compile-timeout)"
    )
    try:
        with pytest.raises(ValueError) as first:
            grammars.compile(spec, tenant).result(timeout=120)
        assert str(first.value) == message and grammars.num_slow == 1
        assert eventually(lambda: None not in grammars.worker_pids, timeout=30)  # killed ones replaced
        compiled, pids = grammars.num_compiled, grammars.worker_pids
        again = grammars.compile(StructuredOutputsParams(regex=slow_regex()), tenant)
        assert again.done() and str(again.exception()) == message
        assert grammars.lookup(spec, tenant).done()
        # no compile queued, no process killed for it
        assert grammars.num_compiled == compiled and grammars.num_slow == 1 and grammars.worker_pids == pids
        # per cache salt: the same name with another salt, or another tenant, compiles it afresh
        assert grammars.lookup(spec, Tenant("alpha", "salt-b")) is None
        assert grammars.lookup(spec, Tenant("beta", "salt-c")) is None
    finally:
        grammars.close()


def test_an_invalid_spec_is_remembered_and_the_memory_is_bounded(tokenizer):
    grammars = grammars_for(tokenizer, timeout_s=10.0, max_refusals=2)
    tenant = Tenant("alpha", "salt-a")
    bad = [StructuredOutputsParams(regex=r) for r in ("(ab", "[z-a]", "a{2,1}")]
    try:
        messages = []
        for spec in bad[:2]:
            with pytest.raises(ValueError, match="structured_outputs.regex: ") as refused:
                grammars.compile(spec, tenant).result(timeout=120)
            messages.append(str(refused.value))
        compiled = grammars.num_compiled
        for spec, message in zip(bad[:2], messages, strict=True):
            again = grammars.compile(spec, tenant)
            assert again.done() and str(again.exception()) == message
        assert grammars.num_compiled == compiled
        with pytest.raises(ValueError):
            grammars.compile(bad[2], tenant).result(timeout=120)
        # two remembered at most: the least recently asked ("(ab") is forgotten, and compiles again
        assert grammars.lookup(bad[0], tenant) is None and grammars.lookup(bad[1], tenant).done()
        # a good spec is unaffected by its tenant's refusals
        assert (
            grammars.compile(StructuredOutputsParams(regex="(ab)+"), tenant).result(timeout=120) is not None
        )
    finally:
        grammars.close()
