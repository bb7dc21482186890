"""`kvserve model wait`: the Kubernetes init containers' wait for the model Job's pull into the shared volume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from shared.defaults import DEFAULT_MODEL
from tests.processes import REPO


def wait_command(cache: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "KVSERVE_CACHE_DIR": cache}
    argv = [sys.executable, "-m", "kvserve.cli", "model", "wait", *args]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_waits_for_the_pulled_directory_then_prints_it(tmp_path, default_model):
    waiting = wait_command(str(tmp_path), "--timeout", "60")
    try:
        time.sleep(2)
        assert waiting.poll() is None  # nothing pulled yet
        # as `kvserve model pull` does: the directory is filled aside, then renamed into place whole
        partial = tmp_path / "partial"
        partial.mkdir()
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(os.path.join(default_model, name), partial / name)
        (partial / "model.safetensors").write_bytes(b"")
        (tmp_path / "models").mkdir()
        partial.rename(tmp_path / "models" / DEFAULT_MODEL)
        out, err = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, err
    assert out.strip() == str(tmp_path / "models" / DEFAULT_MODEL)


def test_gives_up_after_its_timeout_in_one_line(tmp_path):
    waiting = wait_command(str(tmp_path), "--timeout", "0.5")
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "not ready after 0.5 s" in err


def test_runs_in_the_gateway_image_without_the_executor_extra(tmp_path, monkeypatch):
    from tests.kvserve.test_cli import heavy_modules, kvserve

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    done = kvserve("model", "wait", "--timeout", "0.1", without_extra=True)
    assert done.returncode == 1 and "not ready after 0.1 s" in done.stderr  # no torch needed to say so
    assert heavy_modules(done) == []
