"""Where a model's directory is, found without torch: what the gateway reads its tokenizer from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shared.defaults import DEFAULT_MODEL
from shared.model_paths import ModelLoadError, cache_dir, check_model_dir, model_dir, pulled_model_dir


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "kvserve"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_a_pulled_model_is_found_without_a_child(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    pulled = model_dir(DEFAULT_MODEL)
    pulled.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # a child would fail
    assert (
        pulled_model_dir(None)
        == pulled_model_dir(DEFAULT_MODEL)
        == tmp_path / "cache" / "models" / DEFAULT_MODEL
    )


def test_a_new_gguf_file_is_converted_by_a_kvserve_model_pull_child(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    from gateway.prompt.tokenizer import load_tokenizer
    from tests.executor.models.test_model_files import gguf_config, write_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(gguf_config("llama")), "llama")
    assert not model_dir(str(gguf_path)).exists()
    tokenizer = load_tokenizer(str(gguf_path))
    assert pulled_model_dir(str(gguf_path)) == model_dir(str(gguf_path))
    assert (model_dir(str(gguf_path)) / "model.safetensors").is_file()  # the executor's conversion, whole
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the"}])
    assert prompt == "<|im_start|>the<|im_end|>"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 259 and ids[-1] == 260 and 257 in ids  # the special tokens and the merge "he"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the"


def test_a_failed_pull_names_the_command_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match=f"`kvserve model pull {broken}` failed"):
        pulled_model_dir(str(broken))


def test_a_changed_gguf_file_gets_a_directory_of_its_own(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    first = model_dir(str(gguf))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-")
    gguf.write_bytes(b"GGUF, rewritten")
    assert model_dir(str(gguf)) != first


def test_a_directory_is_checked_and_anything_else_refused(tmp_path: Path) -> None:
    assert model_dir(str(tmp_path)) == tmp_path.resolve()  # a tokenizer-only directory serves a gateway
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert pulled_model_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ModelLoadError, match="expected"):
        model_dir(str(tmp_path / "nowhere"))
