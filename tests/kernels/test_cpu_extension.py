"""How the C++ CPU kernels are built: under a name of their own, without waiting on a build that died, and saying
so when a start compiles or waits for another's compile."""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvkernels.cpu_extension import build_name, cpu_kernels, exclusive_build, kernels_build_directory

REPO = Path(__file__).resolve().parents[2]


def test_each_checkout_and_version_of_the_cpu_kernel_builds_under_its_own_name(tmp_path):
    """One shared name made two checkouts on a machine rebuild the kernel (a minute) each after the other ran."""
    here, there = tmp_path / "a" / "kernel.cpp", tmp_path / "b" / "kernel.cpp"
    for path in (here, there):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }")
        (path.parent / "other.cpp").write_text("int g() { return 1; }")
    mine, theirs = (here, here.parent / "other.cpp"), (there, there.parent / "other.cpp")
    flags = (("-O3",), ("-fopenmp",))
    assert build_name(mine, *flags) == build_name(mine, *flags)
    assert build_name(mine, *flags).isidentifier()  # it is also the Python module's name
    assert build_name(mine, *flags) != build_name(theirs, *flags)
    assert build_name(mine, ("-O2",), ("-fopenmp",)) != build_name(mine, *flags)
    here.write_text("int f() { return 2; }")
    assert build_name(mine, *flags) != build_name(theirs, *flags)
    (there.parent / "other.cpp").write_text("int g() { return 2; }")  # any source of the module counts
    here.write_text("int f() { return 1; }")
    assert build_name(mine, *flags) != build_name(theirs, *flags)


def test_a_build_killed_midway_does_not_hang_the_next_start():
    """torch's lock file, which a process killed while building the kernels leaves behind, made every later
    start wait for it forever (an executor that never registered)."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    directory = kernels_build_directory()
    (directory / "lock").write_text("")  # what the killed build left
    code = "from kvkernels.cpu_extension import cpu_kernels; assert cpu_kernels() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=240, check=True)
    assert not (directory / "lock").exists()


def _unbuilt(monkeypatch, tmp_path) -> Path:
    """cpu_kernels() over an empty build directory, torch's load() standing in for the minute-long build."""
    from torch.utils import cpp_extension

    from kvkernels import cpu_extension

    directory = tmp_path / "kvserve_cpu_kernels_test"
    monkeypatch.setattr(cpu_extension, "kernels_build_directory", lambda: directory)
    monkeypatch.setattr(cpu_extension, "kernels_enabled", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: (directory / f"{directory.name}.so").touch())
    cpu_kernels.cache_clear()
    return directory


def test_a_first_start_says_it_is_compiling_and_how_long_that_takes(monkeypatch, tmp_path, caplog):
    """The first start compiled for about a minute without a word; a start that finds the build says nothing."""
    _unbuilt(monkeypatch, tmp_path)
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        cpu_kernels()
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("compiling the CPU kernels") and "about a minute" in m for m in messages)
        assert any(m.startswith("CPU kernels compiled in") for m in messages)
        caplog.clear()
        cpu_kernels.cache_clear()
        cpu_kernels()
        assert not caplog.records
    cpu_kernels.cache_clear()


def test_a_start_waiting_for_anothers_build_says_so(tmp_path, caplog):
    directory = tmp_path / "build"
    directory.mkdir()
    entered = threading.Event()

    def build() -> None:
        with exclusive_build(directory):
            entered.set()

    with (
        open(directory / "kvserve-build.lock", "w") as held,
        caplog.at_level(logging.INFO, "kvserve.kernels"),
    ):
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's build
        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(0.5)
        assert any("waiting for another process compiling" in r.getMessage() for r in caplog.records)
        fcntl.flock(held, fcntl.LOCK_UN)
        waiter.join(10)
    assert entered.is_set()


def test_packing_names_the_layout_it_used(caplog):
    from torch import nn

    from kvkernels.cpu_linear import pack_linears

    layout = "oneDNN's blocked layout" if cpu_kernels() is None else "the CPU kernels' panels"
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert pack_linears(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))) == 2
    assert f"packed 2 linear layers into {layout}" in [r.getMessage() for r in caplog.records]
