"""bench/gpu/session.sh: its dry run (every stage on CPU, in Triton's interpreter, at toy sizes), with every package
the GPU image lacks made unimportable (bench/gpu/image.py), leaves each stage's result and a summary saying each
passed; a stage that fails stops none after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu import image

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu" / "session.sh"
# what a device call brings back from $OUT: at most 8 files
RESULTS = {
    "env.json",
    "kernels.json",
    "tests.xml",
    "e2e.json",
    "figures.json",
    "session.log",
    "summary.txt",
    "gpu_report.md",
}


def run_session(out: Path, python: str, *args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), PYTHON=python)  # passed through: PYTHONPATH too
    if site is not None:  # first, so that its sitecustomize is the one imported
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_dry_run_passes_every_stage_with_only_the_images_packages(default_model, tmp_path):
    site = image.write_site(tmp_path / "site")
    out = tmp_path / "out"
    started = time.perf_counter()
    done = run_session(out, sys.executable, "--dry-run", site=site)
    seconds = time.perf_counter() - started
    print(f"dry run: {seconds:.0f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {path.name for path in out.iterdir()} == RESULTS
    summary = (out / "summary.txt").read_text().strip()
    assert summary == (
        "stages: env ok, model ok, kernels ok, tests ok (collected, none run), e2e ok (profiling: needs CUDA), "
        "figures ok, kv_tiers ok"
    )
    assert done.stdout.rstrip().endswith(summary)
    e2e = json.loads((out / "e2e.json").read_text())
    rows = e2e["end_to_end"]
    backends = ["triton", "triton-eager", "torch", "triton+fp8"]
    assert [(row["dtype"], row["backend"]) for row in rows] == [
        (dtype, backend) for dtype in ("float32", "bfloat16") for backend in backends
    ]
    assert [row["judged"] for row in rows] == [True, True, True, False] + [False] * 4
    assert all(row["output_tokens"] > 0 for row in rows)
    assert e2e["profiling"] == [{"skipped": "needs CUDA"}]
    figures = json.loads((out / "figures.json").read_text())
    assert {row["backend"] for row in figures["throughput"]} == {"triton", "triton-eager", "triton+fp8"}
    assert len(figures["decode_attention"]) == 5
    adapters = figures["adapters"]  # the same prompts on the base model, then over 2 adapters (--toy)
    assert [(row["adapters"], row["output_tokens"]) for row in adapters] == [(0, 4), (2, 4)]
    assert adapters[0]["of_base"] is None and adapters[1]["of_base"] > 0
    revisits = figures["kv_tiers"]["revisit"]["trials"]
    assert revisits and all(t["revisit_cached_tokens_host"] == 240 for t in revisits)
    markdown = (out / "gpu_report.md").read_text()
    assert "Missing" not in markdown and "Greedy tokens by backend" in markdown


def test_a_failing_stage_stops_none_after_it(tmp_path):
    """Every Python step but the report's fails: each stage says so, what needs the model is skipped, the report
    names every missing file, and the exit status says the session failed."""
    broken = tmp_path / "python"
    broken.write_text(
        f'#!/usr/bin/env bash\ncase "$*" in *bench.gpu.report*) exec {sys.executable} "$@" ;; esac\n'
        'echo "broken python: $*" >&2\nexit 1\n'
    )
    broken.chmod(0o755)
    out = tmp_path / "out"
    done = run_session(out, str(broken), "--dry-run")
    assert done.returncode == 1
    assert (out / "summary.txt").read_text().strip() == (
        "stages: env FAILED (no env.json), model FAILED, kernels FAILED (no kernels.json), tests FAILED (no "
        "tests.xml), e2e skipped (no model), figures FAILED (no figures.json), kv_tiers skipped (no model)"
    )
    markdown = (out / "gpu_report.md").read_text()
    assert "Missing from this session: env (env.json), kernels (kernels.json), tests (tests.xml)" in markdown
    assert (
        "broken python: -m bench.gpu.check --section figures --device cpu --toy --no-model"
        in (out / "session.log").read_text()
    )
