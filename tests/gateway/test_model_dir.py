"""The gateway finds a model's tokenizer files without torch; what needs converting, `kvserve model pull` does."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.model_dir import ModelDirError, tokenizer_dir
from gateway.tokenizer import load_tokenizer
from shared.defaults import DEFAULT_MODEL
from shared.model_paths import gguf_model_dir


def test_default_name_is_the_pulled_directory(default_model):
    assert tokenizer_dir(None) == tokenizer_dir(DEFAULT_MODEL) == Path(default_model)


def test_a_directory_is_used_as_is(tmp_path):
    assert tokenizer_dir(str(tmp_path)) == tmp_path


def test_a_new_gguf_file_is_converted_by_kvserve_model_pull(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    from tests.executor.test_model_files import tiny_config, write_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(tiny_config("llama")), "llama")
    assert not gguf_model_dir(gguf_path).exists()
    tokenizer = load_tokenizer(str(gguf_path))
    assert tokenizer_dir(str(gguf_path)) == gguf_model_dir(gguf_path)
    assert (gguf_model_dir(gguf_path) / "model.safetensors").is_file()  # the executor's conversion, whole
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the"}])
    assert prompt == "<|im_start|>the<|im_end|>"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 259 and ids[-1] == 260 and 257 in ids  # the special tokens and the merge "he"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the"


def test_a_failed_pull_names_the_command_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(ModelDirError, match=f"`kvserve model pull {broken}` failed"):
        tokenizer_dir(str(broken))


def test_anything_else_is_refused_naming_what_is_expected(tmp_path):
    with pytest.raises(ModelDirError, match="a .gguf file or a model directory"):
        tokenizer_dir(str(tmp_path / "missing.gguf"))
