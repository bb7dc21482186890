"""The decoder team's rule that no thread writes where another may read (kvkernels/csrc/team_done_bits.h) under
ThreadSanitizer: a small team workload (team_done_bits_workload.cpp) with a stalled thread whose late copies are
dropped runs clean, and the same workload writing every copy, as the team did before, is reported as a race.

The team itself is not built with TSan here (decoder_stack_team.cpp says why)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CSRC = HERE.parent.parent / "kvkernels" / "csrc"


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    binary = tmp_path_factory.mktemp("tsan") / "team_done_bits"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-fsanitize=thread", f"-I{CSRC}",
         str(HERE / "team_done_bits_workload.cpp"), "-o", str(binary)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if build.returncode != 0 and "tsan" in build.stderr.lower():
        pytest.skip(f"ThreadSanitizer's runtime is not installed: {build.stderr[-200:]}")
    assert build.returncode == 0, build.stderr
    return binary


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TSAN_OPTIONS": "exitcode=66"}
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60, env=env)


def test_late_copies_kept_by_one_thread_run_clean_under_thread_sanitizer(workload):
    result = _run(workload)
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stdout + result.stderr[-1000:]


def test_a_late_thread_writing_its_copy_is_reported_as_a_race(workload):
    """What makes the clean run mean something: the old convention, under the same stall, is caught."""
    result = _run(workload, "late-writes")
    assert result.returncode == 66
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
