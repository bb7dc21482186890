"""bench/gpu/kv_tiers.py, the GPU session's kv_tiers stage, at a CPU smoke's scale: it adds its section to the file
it is given and keeps what else is there; every revisit comes back whole from the host tier, byte for byte, with
the first visit's tokens; asked for CUDA where there is none it skips cleanly; and report.py judges and renders
the section."""

from __future__ import annotations

import json

import pytest
import torch

from bench.gpu import kv_tiers, report

SMOKE = ["--device", "cpu", "--tokens", "256", "--blocks", "16", "--trials", "2", "--iters", "2"]


@pytest.fixture(scope="module")
def smoke(tiny_models, tmp_path_factory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp("session") / "figures.json"
    out.write_text(json.dumps({"device": "cpu", "throughput": [], "errors": {}}))  # the figures stage's
    rc = kv_tiers.main(["--model", tiny_models["llama"], *SMOKE, "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_the_smoke_run_adds_its_section_beside_the_figures(smoke):
    rc, figures = smoke
    assert rc == 0
    assert figures["throughput"] == [] and figures["errors"] == {}
    section = figures["kv_tiers"]
    assert section["device"] == "cpu" and section["dtype"] == "float32" and section["seconds"] > 0
    # tiny llama: 2 layers, K and V, 16 tokens, 2 KV heads of 16 dims, float32
    assert section["block_bytes"] == 2 * 2 * 16 * 2 * 16 * 4
    bandwidth = section["bandwidth"]
    assert bandwidth["blocks"] == 16
    directions = [(row["direction"], row["path"]) for row in bandwidth["rows"]]
    assert directions == [
        ("device to host", "offloader: BlockCopies.gather + HostTier.write"),
        ("device to host", "BlockCopies.gather alone"),
        ("device to host", "one contiguous copy"),
        ("host to device", "loads: BlockCopies.write"),
        ("host to device", "one contiguous copy"),
    ]
    assert all(row["gbps"] > 0 and row["ms"] > 0 for row in bandwidth["rows"])


def test_each_revisit_loads_its_whole_prefix_from_the_host_tier_as_computed(smoke):
    revisit = smoke[1]["kv_tiers"]["revisit"]
    assert (
        revisit["prompt_tokens"] == 256 and revisit["expected_cached_tokens"] == 240
    )  # never the last token's
    assert revisit["tokens_judged"] and len(revisit["trials"]) == 2
    for trial in revisit["trials"]:
        assert trial["revisit_cached_tokens"] == trial["revisit_cached_tokens_host"] == 240
        assert trial["blocks_identical"] == trial["blocks_compared"] == 15
        assert trial["tokens"] == "same" and trial["tokens_ok"]
        assert trial["recompute_ttft_ms"] > 0 and trial["revisit_ttft_ms"] > 0
    ratio = revisit["revisit_ttft_ms"] / revisit["recompute_ttft_ms"]
    assert revisit["revisit_over_recompute"] == pytest.approx(ratio, abs=1e-3)


def test_the_report_renders_the_section_and_the_summary_has_nothing_to_say(smoke, tmp_path):
    figures = smoke[1]
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    assert report.stage_note("kv_tiers", tmp_path) == ""
    markdown = report.render_session(tmp_path)
    assert "| host to device | loads: BlockCopies.write |" in markdown
    assert "A revisited 256-token prompt, its prefix loaded from the host tier" in markdown
    assert "prefix tokens from the host tier: 240, 240 of 240" in markdown


def test_a_revisit_that_falls_short_is_a_problem_and_its_note(smoke, tmp_path):
    section = json.loads(json.dumps(smoke[1]["kv_tiers"]))
    first, second = section["revisit"]["trials"]
    first |= {"revisit_cached_tokens_host": 96, "revisit_cached_tokens": 160}
    second |= {"blocks_identical": 14, "tokens": "parted at a 0.5-nat margin", "tokens_ok": False}
    assert report.problems({"kv_tiers": section}) == [
        "kv_tiers trial 1: the revisit loaded 96 of 240 prefix tokens from the host tier (160 cached in all)",
        "kv_tiers trial 2: 14 of 15 loaded blocks hold the bytes first computed",
        "kv_tiers trial 2: the revisit's greedy tokens parted at a 0.5-nat margin from the first's",
    ]
    (tmp_path / "figures.json").write_text(json.dumps({"throughput": [], "kv_tiers": section}))
    assert report.stage_note("kv_tiers", tmp_path).startswith("kv_tiers trial 1: the revisit loaded 96")


def test_a_missing_section_and_a_failed_stage_are_named(tmp_path):
    (tmp_path / "figures.json").write_text(json.dumps({"throughput": []}))
    assert report.stage_note("kv_tiers", tmp_path) == "no kv_tiers in figures.json"
    failed = {"errors": {"kv_tiers": {"error": "RuntimeError('pinned')", "traceback": "..."}}, "kv_tiers": {}}
    (tmp_path / "figures.json").write_text(json.dumps(failed))
    assert report.stage_note("kv_tiers", tmp_path) == "kv_tiers raised RuntimeError('pinned')"
    assert "**kv_tiers failed**: `RuntimeError('pinned')`" in report.render_session(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_device_skips_cleanly(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert kv_tiers.main(["--model", str(tmp_path), "--out", str(out)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert json.loads(out.read_text())["kv_tiers"] == {
        "skipped": "no CUDA device (torch.cuda.is_available() is False)"
    }
    (tmp_path / "figures.json").write_text(out.read_text())
    assert (
        report.stage_note("kv_tiers", tmp_path)
        == "kv_tiers: no CUDA device (torch.cuda.is_available() is False)"
    )
