"""How the C++ CPU kernels are built: under a name of their own, and without waiting on a build that died."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu_extension import build_name, cpu_kernels, kernels_build_directory

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
    code = "from kernels.cpu_extension import cpu_kernels; assert cpu_kernels() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=240, check=True)
    assert not (directory / "lock").exists()
