"""The LoRA benchmark's tables: each arm against its own system's base-only arm, and the 8-adapter target."""

from bench.lora.report import arm_rows, tables


def _arm(adapters: int, tokens_per_s: float | None, failed: int = 0) -> dict:
    summary = {
        "output_tokens_per_s": tokens_per_s,
        "ttft_ms": {"p50": 410.4},
        "itl_ms": {"p50": 95.6},
        "completed": 48 - failed,
        "failed": failed,
    }
    return {"adapters": [f"a{i}" for i in range(adapters)], "summary": summary}


def _load() -> dict:
    return {
        "base_ttft_s": 0.2,
        "first_use_ttft_s": 0.5,
        "loaded_ttft_s": 0.25,
        "load_s": 0.25,
        "first_use_minus_base_s": 0.3,
        "errors": [],
    }


def _report(rates: dict[int, float | None]) -> dict:
    names = {0: "base only", 1: "1 adapter", 4: "4 adapters", 8: "8 adapters"}
    return {"arms": {names[n]: _arm(n, rate) for n, rate in rates.items()}, "load": _load()}


def test_ratios_are_against_base_only_and_the_target_is_on_the_eight_adapter_row():
    rows = arm_rows("kvserve", _report({0: 100.0, 1: 95.0, 4: 90.0, 8: 79.0}))
    assert [(r.arm, r.tokens_per_s, r.vs_base) for r in rows] == [
        ("base only", "100.0", "1.00x"),
        ("1 adapter", "95.0", "0.95x"),
        ("4 adapters", "90.0", "0.90x"),
        ("8 adapters", "79.0", "0.79x"),
    ]
    assert [r.met for r in rows] == [None, None, None, False] and rows[3].target == ">= 0.8x"
    assert rows[0].ttft_p50 == "410 ms" and rows[0].itl_p50 == "96 ms" and rows[0].failed == "0 of 48"
    assert arm_rows("kvserve", _report({0: 100.0, 8: 80.0}))[1].met is True


def test_an_arm_that_measured_nothing_has_no_ratio_and_no_verdict():
    rows = arm_rows("vLLM CPU", _report({0: 100.0, 8: None}))
    assert rows[1].tokens_per_s == "-" and rows[1].vs_base == "-" and rows[1].met is None
    assert arm_rows("x", _report({0: None, 1: 50.0}))[1].vs_base == "-"


def test_both_tables_hold_a_row_per_system():
    text = tables({"kvserve": _report({0: 100.0, 8: 85.0}), "vLLM CPU": _report({0: 120.0, 8: 60.0})})
    arms, loads = text.split("\n\n")
    assert arms.count("\n") == 1 + 4 and "| kvserve | 8 adapters | 85.0 | 0.85x |" in arms
    assert "| vLLM CPU | 8 adapters | 60.0 | 0.50x |" in arms and "**no**" in arms
    assert "| kvserve | 200 ms | 500 ms | 250 ms | 250 ms | 300 ms | 0 |" in loads
