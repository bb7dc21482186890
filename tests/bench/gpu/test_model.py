"""bench/gpu/model.py: the default model's small files packed, a random-weight model built from them that the engine
serves; and bench/gpu/session.sh, which runs on the GPU machine only, at least parses and names real files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from bench.gpu import model
from executor import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[3]


def test_pack_copies_everything_but_the_weights(default_model, tmp_path):
    names = model.pack(tmp_path / "packed")
    assert "config.json" in names and "tokenizer.json" in names
    assert not list((tmp_path / "packed").glob("*.safetensors"))
    assert sum(f.stat().st_size for f in (tmp_path / "packed").iterdir()) < 8 * 2**20  # travels easily


def pack_tiny(tiny_models, tmp_path) -> Path:
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (packed / name).write_bytes((Path(tiny_models["llama"]) / name).read_bytes())
    return packed


def test_built_model_has_the_packed_shapes_and_serves(tiny_models, tmp_path):
    packed = pack_tiny(tiny_models, tmp_path)
    built = model.build(packed, tmp_path / "built")
    config = json.loads((built / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["initializer_range"] == model.INIT_STD
    llm = LLM(str(built), device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = llm.generate(["Hello there", "Another prompt"], params)
    assert all(len(out.outputs[0].token_ids) == 6 for out in tokens)
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    assert model.build(packed, built) == built  # a second build keeps the first
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime


def test_num_layers_changes_the_depth_alone_and_a_rebuild_follows_it(tiny_models, tmp_path):
    packed = pack_tiny(tiny_models, tmp_path)
    assert model.main(["build", str(packed), str(tmp_path / "built"), "--num-layers", "1"]) == 0
    packed_config = json.loads((packed / "config.json").read_text())
    config = json.loads((tmp_path / "built" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    changed = {
        key for key in config.keys() | packed_config.keys() if config.get(key) != packed_config.get(key)
    }
    assert changed <= {"num_hidden_layers", "initializer_range", "dtype"}
    llm = LLM(str(tmp_path / "built"), device="cpu", kv_cache_memory="8MiB")
    assert llm.engine.runner.model.spec.num_layers == 1
    model.build(packed, tmp_path / "built")  # the packed depth again: built anew, not kept
    assert json.loads((tmp_path / "built" / "config.json").read_text())["num_hidden_layers"] == 2


def test_num_layers_below_one_is_refused(tiny_models, tmp_path, capsys):
    packed = pack_tiny(tiny_models, tmp_path)
    assert model.main(["build", str(packed), str(tmp_path / "built"), "--num-layers", "0"]) == 2
    assert "num_layers: must be at least 1" in capsys.readouterr().err


def test_build_without_a_packed_config_says_how_to_pack(tmp_path, capsys):
    assert model.main(["build", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "python -m bench.gpu.model pack" in capsys.readouterr().err


def test_the_session_script_parses_and_its_test_files_exist():
    script = ROOT / "bench" / "gpu" / "session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    paths = re.findall(r"tests/\S+\.py", script.read_text())
    assert len(paths) >= 5 and all((ROOT / p).is_file() for p in paths)
    assert ".gpu/" in (ROOT / ".gitignore").read_text().split()  # carried, never committed
