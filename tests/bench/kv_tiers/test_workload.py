"""The KV tiers benchmark's arithmetic and its table: sizes from a model's config, what each part's rows say
against its target, and when the disk tier's files count as settled."""

import random

from bench.kv_tiers import conversations, pulls, restart
from bench.kv_tiers.workload import (
    Conversations,
    ConversationShape,
    Row,
    kv_bytes_per_token,
    markdown_table,
    random_token_prompt,
    tier_sizes,
)

SMOLLM2_135M = {  # the default model's config.json, the fields that size its KV
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 30,
}
FULL = ConversationShape(users=32, turns=8, document_tokens=1000, message_tokens=125, max_output_tokens=32)


def test_a_tokens_kv_comes_from_the_models_config():
    assert kv_bytes_per_token(SMOLLM2_135M) == 30 * 2 * 3 * 64 * 4 == 46_080
    no_head_dim = {k: v for k, v in SMOLLM2_135M.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim) == 46_080  # hidden size / heads
    no_gqa = {k: v for k, v in no_head_dim.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token(no_gqa, dtype_bytes=2) == 30 * 2 * 9 * 64 * 2


def test_the_full_run_has_a_pool_an_eighth_of_the_working_set_and_a_tier_that_holds_it():
    assert 2000 <= FULL.history_tokens() <= 2500  # histories grow to about 2k tokens
    sizes = tier_sizes(FULL, 46_080, 0.125)
    assert sizes.working_set == 32 * FULL.history_tokens() * 46_080
    assert sizes.pool == sizes.working_set // 8 and not sizes.pool_floored
    assert sizes.host > sizes.working_set


def test_a_scaled_down_runs_pool_still_holds_two_conversations():
    small = ConversationShape(users=2, turns=2, document_tokens=200, message_tokens=40, max_output_tokens=8)
    sizes = tier_sizes(small, 46_080, 0.125)
    assert sizes.pool_floored and sizes.pool == 2 * small.history_tokens() * 46_080


def test_no_two_users_or_turns_share_a_prefix():
    texts = Conversations(ConversationShape(3, 3, 50, 20, 8), seed=0)
    firsts = [texts.input(u, 0) for u in range(3)]
    assert len({t[:40] for t in firsts}) == 3 and all("document" in t for t in firsts)
    assert len({texts.input(u, k)[:40] for u in range(3) for k in (1, 2)}) == 6
    prompt = random_token_prompt(random.Random(1), 512, 49_152)
    assert len(prompt) == 512 and min(prompt) >= 256 and max(prompt) < 49_152


def _run(share, p50_s, p90_s, revisits=None):
    ttft = {"p50": p50_s * 1000, "p90": p90_s * 1000}
    revisit = ttft if revisits is None else {"p50": revisits[0] * 1000, "p90": revisits[1] * 1000}
    return {"cached_share": share, "ttft_ms": ttft, "revisit_ttft_ms": revisit}


def test_conversation_rows_judge_the_share_with_the_tier_and_the_p90_ratio_of_all_turns_and_revisits():
    report = {"runs": {"no tier": _run(0.05, 2.0, 6.0), "host tier": _run(0.85, 0.5, 1.5, (0.4, 0.5))}}
    share, p50, p90, revisit_p50, revisit_p90 = conversations.rows(report)
    assert (share.baseline, share.tiers, share.met) == ("0.050", "0.850", True)
    assert p50.ratio == "4.00x better" and p50.met is None
    assert (p90.baseline, p90.tiers, p90.ratio, p90.met) == ("6,000 ms", "1,500 ms", "4.00x better", True)
    assert "revisits" in revisit_p90.measure and revisit_p90.ratio == "12.00x better" and revisit_p90.met
    assert revisit_p50.met is None
    report["runs"]["host tier"] = _run(0.7, 0.5, 2.5)
    share, _, p90, _, revisit_p90 = conversations.rows(report)
    assert share.met is False and p90.met is False and revisit_p90.met is False


def test_admission_rows_compare_recency_with_reuse_on_the_host_tier_alone():
    recency, reuse = _run(0.84, 0.5, 1.5, (0.4, 0.5)), _run(0.45, 1.0, 3.0, (0.8, 2.0))
    share, p50, p90 = conversations.rows({"runs": {"host tier": recency, conversations.REUSE_RUN: reuse}})
    assert (share.baseline, share.tiers) == ("0.840", "0.450") and "recency vs reuse" in share.measure
    assert (p90.baseline, p90.tiers, p90.ratio) == ("500 ms", "2,000 ms", "recency 4.00x better")
    assert p50.ratio == "recency 2.00x better" and p90.met is None
    both = conversations.rows(
        {"runs": {"no tier": _run(0.05, 2.0, 6.0), "host tier": recency, conversations.REUSE_RUN: reuse}}
    )
    assert len(both) == 5 + 3


def test_pull_rows_hold_the_target_at_2k_only_and_say_how_much_was_pulled():
    def length(asked, pull, recompute):
        return {
            "asked_tokens": asked,
            "pull_ttft_s": pull,
            "recompute_ttft_s": recompute,
            "pulled_tokens": [496],
        }

    report = {"lengths": {"512": length(512, 0.3, 1.0), "2048": length(2048, 1.0, 5.0)}}
    short, at_2k = pulls.rows(report, repeats=3)
    assert (short.ratio, short.target, short.met) == ("0.30x", "", None)
    assert (at_2k.ratio, at_2k.target, at_2k.met) == ("0.20x", "<= 0.25x", True)
    assert "median of 3" in at_2k.measure and "496 tokens" in at_2k.measure


def test_restart_rows_judge_the_revisits():
    report = {"prompts": 20, "first": _run(0.0, 2.0, 3.0), "after_restart": _run(0.95, 0.2, 0.3)}
    share, ttft = restart.rows(report)
    assert "first 20 revisits" in share.measure and share.met is True
    assert (ttft.baseline, ttft.tiers) == ("2,000 ms", "200 ms")


def test_the_table_is_markdown_with_a_line_per_row():
    table = markdown_table(
        [Row("(c)", "cached share", "0.000", "0.981", "", ">= 0.9", True), Row("(a)", "x", "-", "-")]
    )
    lines = table.splitlines()
    assert lines[0] == "| part | measure | baseline | KV tiers | ratio | target | met |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == "| (c) | cached share | 0.000 | 0.981 |  | >= 0.9 | yes |"
    assert lines[3].endswith("|  |  |  |")


def test_block_files_count_once_none_has_come_for_a_while(tmp_path, monkeypatch):
    monkeypatch.setattr(restart, "SETTLED_S", 0.3)
    (tmp_path / "executor-0").mkdir()
    for name in ("a.kvb", "b.kvb", "c.kvb.tmp"):
        (tmp_path / "executor-0" / name).write_bytes(b"x")
    assert restart.wait_for_block_files(tmp_path) == 2
