"""Where a model's directory is, found without torch: what the gateway reads its tokenizer from."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.defaults import DEFAULT_MODEL
from shared.model_paths import ModelLoadError, cache_dir, model_dir, pulled_model_dir


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "kvserve"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_a_model_not_pulled_yet_is_an_error_that_says_how_to_pull_it(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="`kvserve model pull` first"):
        pulled_model_dir(None)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=f"`kvserve model pull {gguf}` first"):
        pulled_model_dir(str(gguf))
    pulled = model_dir(DEFAULT_MODEL)
    pulled.mkdir(parents=True)
    assert (
        pulled_model_dir(None)
        == pulled_model_dir(DEFAULT_MODEL)
        == tmp_path / "cache" / "models" / DEFAULT_MODEL
    )


def test_a_changed_gguf_file_gets_a_directory_of_its_own(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    first = model_dir(str(gguf))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-")
    gguf.write_bytes(b"GGUF, rewritten")
    assert model_dir(str(gguf)) != first


def test_a_directory_is_checked_and_anything_else_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert pulled_model_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ModelLoadError, match="expected"):
        model_dir(str(tmp_path / "nowhere"))
