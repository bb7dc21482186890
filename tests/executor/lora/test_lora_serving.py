"""LoRA adapters beside the base model: each adapter's greedy output equals HF transformers on the weights PEFT
merges, in one batch mixing the base and several adapters; no prefix-cache block is shared across adapters; bad
adapters are refused with an error naming what is wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from executor import LLM, SamplingParams
from executor.lora.adapter_files import AdapterError
from tests.executor.lora.conftest import ADAPTERS
from tests.executor.test_hf_equivalence import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def serving(tiny_models, adapters, **settings) -> LLM:
    """The tiny llama in float32 serving every adapter of the fixture."""
    lora_modules = {name: paths[0] for name, paths in adapters.items()}
    return LLM(
        tiny_models["llama"],
        kv_cache_memory="8MiB",
        max_model_len=512,
        quantization="none",
        enable_lora=True,
        lora_modules=lora_modules,
        **settings,
    )


@pytest.fixture(scope="module")
def llm(tiny_models, adapters) -> LLM:
    return serving(tiny_models, adapters, max_loras=3)


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(length)] for _ in range(n)]


def test_each_adapter_answers_as_hf_on_the_merged_weights_in_one_mixed_batch(tiny_models, adapters, llm):
    texts = prompts(2)
    names = [None, *ADAPTERS]
    batch = [text for text in texts for _ in names]
    loras = [name for _ in texts for name in names]
    outs = llm.generate(batch, GREEDY, lora=loras)
    for out, text, name in zip(outs, batch, loras, strict=True):
        model_dir = tiny_models["llama"] if name is None else adapters[name][1]
        assert out.outputs[0].token_ids == hf_greedy(model_dir, [text], MAX_NEW)[0], name
    base = [o.outputs[0].token_ids for o, n in zip(outs, loras, strict=True) if n is None]
    assert all(o.outputs[0].token_ids not in base for o, n in zip(outs, loras, strict=True) if n), (
        "an adapter that changes nothing tests nothing"
    )


def test_no_prefix_block_is_shared_across_adapters_or_with_the_base(llm):
    text = prompts(1, length=70, seed=5)[0]  # four full blocks that can be cached
    assert llm.generate([text], GREEDY)[0].num_cached_tokens == 0
    for name in ADAPTERS:
        assert llm.generate([text], GREEDY, lora=name)[0].num_cached_tokens == 0, name
    for name in [None, *ADAPTERS]:
        assert llm.generate([text], GREEDY, lora=name)[0].num_cached_tokens == 64, name


def test_more_adapters_than_max_loras_take_turns_with_the_same_answers(tiny_models, adapters, llm):
    one_at_a_time = serving(tiny_models, adapters, max_loras=1, max_cpu_loras=2)
    texts = prompts(3, seed=7)
    loras = list(ADAPTERS)
    alone = one_at_a_time.generate(texts, GREEDY, lora=loras)
    together = llm.generate(texts, GREEDY, lora=loras)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in together]
    for name in loras:  # one at a time: host memory keeps the two most recently used
        one_at_a_time.generate(texts[:1], GREEDY, lora=name)
    assert one_at_a_time.engine.adapters.names_held == loras[1:]


def test_an_unknown_adapter_or_one_without_lora_is_a_clear_error(tiny_models, llm):
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        llm.generate(prompts(1), GREEDY, lora="nope")
    plain = LLM(tiny_models["llama"], kv_cache_memory="1MiB", max_model_len=256)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate(prompts(1), GREEDY, lora="qv")
    assert llm.generate(prompts(1), GREEDY)[0].finished  # nothing else broke


def _copy_adapter(src: str, dst: Path, config_changes: dict | None = None) -> Path:
    dst.mkdir()
    config = json.loads((Path(src) / "adapter_config.json").read_text()) | (config_changes or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes((Path(src) / "adapter_model.safetensors").read_bytes())
    return dst


def test_bad_adapters_are_refused_naming_what_is_wrong(tiny_models, adapters, llm, tmp_path):
    from safetensors.torch import load_file, save_file

    good = adapters["qv"][0]
    register = llm.engine.adapters.register
    with pytest.raises(AdapterError, match="over --max-lora-rank 16"):
        register("big", _copy_adapter(good, tmp_path / "big", {"r": 32}))
    with pytest.raises(AdapterError, match="DoRA"):
        register("dora", _copy_adapter(good, tmp_path / "dora", {"use_dora": True}))
    with pytest.raises(AdapterError, match="cannot adapt lm_head"):
        register("head", _copy_adapter(good, tmp_path / "head", {"target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        register("empty", tmp_path)
    tensors = load_file(str(Path(good) / "adapter_model.safetensors"))
    broken = {
        "missing": {k: v for k, v in tensors.items() if "layers.1.self_attn.v_proj.lora_B" not in k},
        "shape": {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in tensors.items()},
    }
    for name, changed in broken.items():
        path = _copy_adapter(good, tmp_path / name)
        save_file(changed, str(path / "adapter_model.safetensors"))
        register(name, path)  # its config is fine: its weights are checked when first used
        with pytest.raises(AdapterError, match="lacks its lora_B" if name == "missing" else "needs"):
            llm.generate(prompts(1), GREEDY, lora=name)
    (tmp_path / "missing" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError):
        llm.generate(prompts(1), GREEDY, lora="missing")
    assert llm.generate(prompts(1), GREEDY, lora="qv")[0].finished  # nothing else broke


def test_a_loading_adapter_holds_only_its_own_requests(tiny_models, adapters, llm, monkeypatch):
    """The adapter's files are read by a worker while its request waits outside the scheduler: a base request
    runs to the end meanwhile; a load that fails ends its request with the error (a 400), nothing else."""
    import threading

    engine = llm.engine
    release = threading.Event()
    load = engine.adapters.load

    def slow_load(known):
        assert release.wait(60)
        return load(known)

    monkeypatch.setattr(engine.adapters, "load", slow_load)
    engine.adapters._held.clear()
    base, tuned = prompts(2, seed=11)
    engine.add_request("tuned", tuned, GREEDY, lora="qv")
    engine.add_request("base", base, GREEDY)
    assert engine.adapter_loads.holds("tuned") and engine.stats().waiting == 2  # held ones count as waiting
    tokens = {"base": 0, "tuned": 0}
    while tokens["base"] < MAX_NEW:
        for out in engine.step().outputs:
            tokens[out.request_id] += len(out.new_token_ids)
    assert tokens["tuned"] == 0 and engine.adapter_loads.holds("tuned")
    release.set()
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += len(out.new_token_ids)
    assert tokens["tuned"] == MAX_NEW and engine.adapters.names_held == ["qv"]
    monkeypatch.setattr(
        engine.adapters, "load", lambda known: (_ for _ in ()).throw(AdapterError("bad weights"))
    )
    engine.adapters._held.clear()
    engine.add_request("broken", tuned, GREEDY, lora="all")
    errors = []
    while engine.has_unfinished():
        errors += [(o.error, o.error_code) for o in engine.step().outputs if o.error]
    assert errors == [("bad weights", 400)]


def test_a_step_of_decodes_under_adapters_runs_in_the_cpp_stack_with_the_python_loops_bits(tiny_models, llm):
    """The C++ decoder stack adds each adapter's update after each projection as the Python loop does: the same
    hidden states, bit for bit, for a step of decodes mixing the base and every adapter."""
    from executor.lora.lora_batch import LoRABatch
    from executor.models.llama import AttentionBatch

    model = llm.engine.runner.model
    if model.decoder_stack is None:
        pytest.skip("the C++ decoder stack is not built here")
    weights = {}
    for name in ADAPTERS:
        llm.engine.load_adapter(name)
        weights[name] = llm.engine.adapters.held(llm.engine.adapters.resolve(name))
    names = sorted([None, None, *ADAPTERS, "qv"], key=lambda n: n or "")  # as the runner sorts a step's rows
    rows = [None if name is None else weights[name] for name in names]
    count = len(rows)
    query_start = torch.arange(count + 1)
    lora = LoRABatch.of_chunks(rows, query_start, torch.device("cpu"))
    block_size = llm.engine.block_size
    batch = AttentionBatch(
        slot_mapping=torch.arange(count) * block_size + 3,
        block_table=torch.arange(count, dtype=torch.int32)[:, None],
        seq_lens=torch.full((count,), 4, dtype=torch.int32),
        query_start_loc=query_start.to(torch.int32),
        lora=lora,
    )
    ids, positions = torch.randint(1, 1000, (count,)), torch.full((count,), 3)
    caches = llm.engine.runner.kv_caches
    with torch.inference_mode():
        in_stack = model(ids, positions, caches, batch)
        stack, model.decoder_stack = model.decoder_stack, None
        try:
            in_python = model(ids, positions, caches, batch)
        finally:
            model.decoder_stack = stack
        base = model(
            ids,
            positions,
            caches,
            AttentionBatch(
                *[getattr(batch, f) for f in ("slot_mapping", "block_table", "seq_lens", "query_start_loc")]
            ),
        )
    assert torch.equal(in_stack, in_python)
    assert torch.equal(in_stack[:2], base[:2]) and not torch.equal(in_stack[2:], base[2:])
