"""Decode steps through CUDA graphs: the padded static-buffer forward gives the eager logits and writes only the
real tokens' KV, the engine's greedy tokens do not change, and which steps take the graph path.

Without CUDA the padded forward runs eagerly over the same buffers (capture=False), with the torch kernels and
with the Triton kernels in Triton's interpreter; with CUDA, real graphs are captured and replayed too."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())

from executor import LLM, SamplingParams  # noqa: E402
from executor.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from executor.engine_args import add_engine_args, config_from_args, engine_argv  # noqa: E402
from executor.model_runner import Chunk, ModelRunner  # noqa: E402
from executor.models.loader import build_model, decoder_spec  # noqa: E402
from executor.models.model_files import load_weights, read_config  # noqa: E402
from kvkernels.backend import TORCH, choose_kernels  # noqa: E402

CUDA = torch.cuda.is_available() and not INTERPRETING
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
BLOCK = 16


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(2000)[-1] == 512  # larger batches run eagerly


def test_enforce_eager_flag_parses_and_round_trips():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(["--enforce-eager"]))
    assert config.enforce_eager is True
    assert engine_argv(config) == ["--enforce-eager"]
    assert config_from_args(parser.parse_args([])).enforce_eager is False


def _runner(model_dir: str, kernels, device: str) -> ModelRunner:
    model_dir = Path(model_dir)
    spec = decoder_spec(read_config(model_dir))
    model = build_model(spec, load_weights(model_dir), torch.float32, torch.device(device), kernels)
    runner = ModelRunner(model, 24, BLOCK, torch.device(device), torch.float32)
    runner.kv_cache.zero_()
    return runner


def _prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> None:
    runner.run([Chunk(table, 0, prompt, 1) for prompt, table in zip(prompts, tables, strict=True)])


# three sequences: 5 tokens (a partial first block), 16 (the decode opens a second block), 33
PROMPTS = [list(range(7, 12)), list(range(40, 56)), list(range(100, 133))]
TABLES = [[3], [9, 4], [1, 7, 12]]


def _decode_chunks(step: int) -> list[Chunk]:
    return [
        Chunk(table, len(prompt) + step, [prompt[-1] + 1 + step], 1)
        for prompt, table in zip(PROMPTS, TABLES, strict=True)
    ]


def _kernels(name: str, device: str):
    if name == "triton":
        pytest.importorskip("triton")
    return choose_kernels(name, torch.device(device))


@pytest.mark.parametrize(
    "backend,device",
    [
        ("torch", "cpu"),
        pytest.param("triton", "cpu", marks=pytest.mark.skipif(not INTERPRETING, reason="interpreter off")),
        pytest.param("triton", "cuda", marks=needs_cuda),
    ],
)
def test_padded_decode_gives_eager_logits_and_writes_only_real_slots(tiny_models, backend, device):
    kernels = _kernels(backend, device)
    eager, padded = (_runner(tiny_models["llama"], kernels, device) for _ in range(2))
    padded.enable_decode_graphs(max_num_seqs=8, max_model_len=256, capture=device == "cuda")
    for runner in (eager, padded):
        _prefill(runner, PROMPTS, TABLES)
    for step in range(2):  # the second step refills the buffers the first left behind
        chunks = _decode_chunks(step)
        assert padded._decode_rows(chunks) is not None  # 3 rows, padded to 4
        got, expected = padded.run(chunks), eager.run(chunks)
        assert got.shape == expected.shape == (3, eager.model.spec.vocab_size)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        # padding wrote no KV: block 0, which padding tokens read, and every other block match the eager run
        torch.testing.assert_close(padded.kv_cache, eager.kv_cache, atol=1e-4, rtol=1e-4)
    assert padded.kv_cache[:, :, 0].abs().sum() == 0


def test_only_decode_steps_that_fit_take_the_padded_path(tiny_models):
    runner = _runner(tiny_models["llama"], TORCH, "cpu")
    assert runner._decode_rows(_decode_chunks(0)) is None  # graphs not enabled
    runner.enable_decode_graphs(max_num_seqs=2, max_model_len=64, capture=False)
    assert [len(r.block_ids) for r in runner._decode_rows(_decode_chunks(0)[:2])] == [1, 2]
    assert runner._decode_rows(_decode_chunks(0)) is None  # 3 sequences: more than the largest size
    prefill = Chunk([5], 0, [1, 2, 3], 1)
    assert runner._decode_rows([_decode_chunks(0)[0], prefill]) is None  # a mixed step
    verify = Chunk([3], 5, [12, 13], 2)
    assert runner._decode_rows([verify]) is None  # a proposal being verified: two logits rows
    too_long = Chunk(list(range(5)), 70, [1], 1)
    assert runner._decode_rows([too_long]) is None  # past max_model_len's block table width


def test_capture_refuses_a_backend_that_reads_lengths_back(tiny_models):
    runner = _runner(tiny_models["llama"], TORCH, "cpu")
    with pytest.raises(ValueError, match="torch attention backend .* --enforce-eager"):
        runner.enable_decode_graphs(max_num_seqs=4, max_model_len=64, capture=True)


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    """Five requests decoding together once their prompts (some longer than a step's budget) are in."""
    prompts = [list(range(5, 5 + n)) for n in (3, 21, 40, 9, 16)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_engine_greedy_tokens_do_not_change_on_the_padded_path(tiny_models, monkeypatch):
    calls = []
    run = DecodeGraphs.run

    def counting_run(self, rows):
        calls.append(len(rows))
        return run(self, rows)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    outputs = []
    for padded in (False, True):
        llm = LLM(tiny_models["qwen3"], device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=32)
        if padded:
            llm.engine.runner.enable_decode_graphs(8, llm.engine.max_model_len, capture=False)
        outputs.append(_greedy_tokens(llm))
    assert outputs[0] == outputs[1]
    assert calls and 5 in calls  # all five decoding together, padded to 8


@needs_cuda
def test_engine_on_cuda_captures_graphs_and_gives_the_eager_tokens(tiny_models):
    outputs = []
    for enforce_eager in (True, False):
        llm = LLM(
            tiny_models["llama"],
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            kv_cache_memory="64MiB",
            max_num_seqs=16,
            enforce_eager=enforce_eager,
        )
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == enforce_eager
        if graphs is not None:
            assert sorted(graphs.graphs) == capture_sizes(16)
        outputs.append(_greedy_tokens(llm))
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def default_layout(default_model, tmp_path_factory) -> str:
    """The default model's layout (9 query / 3 KV heads of 64, 576 wide, 49k vocabulary) in bf16, with its own
    first two layers. Not random weights: in bf16 those give near-ties every few tokens (top-2 margins of one
    bf16 step at the logits' size), where greedy agreement between any two kernels hinges on rounding."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, path = Path(default_model), tmp_path_factory.mktemp("default-layout")
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(config))
    kept = re.compile(r"model\.layers\.(\d+)\.")
    weights = {
        name: tensor.to(torch.bfloat16)
        for name, tensor in load_file(source / "model.safetensors").items()
        if (match := kept.match(name)) is None or int(match.group(1)) < 2
    }
    save_file(weights, path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(source / name, path / name)
    return str(path)


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.mark.skipif(not INTERPRETING, reason="the interpreter is off: on CUDA the test above captures graphs")
def test_default_layout_in_bf16_padded_with_an_h200s_splits_gives_the_torch_tokens(
    default_layout, monkeypatch
):
    """What an H200 runs first: bf16, the padded decode path at max_model_len 2048, the Triton kernel splitting
    each context as it would over 132 multiprocessors; greedy tokens as the torch backend's."""
    from bench.gpu.triton_compile_check import H200_SMS
    from kvkernels import triton_attention

    splits = []
    choose = triton_attention.choose_num_splits
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: H200_SMS)
    monkeypatch.setattr(
        triton_attention, "choose_num_splits", lambda *args: splits.append(choose(*args)) or splits[-1]
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            default_layout,
            device="cpu",
            dtype="bfloat16",
            attention_backend=backend,
            max_model_len=2048,
            kv_cache_memory="16MiB",
            max_num_seqs=4,
        )
        if backend == "triton":
            llm.engine.runner.enable_decode_graphs(4, llm.engine.max_model_len, capture=False)
        runs[backend] = [o.outputs[0] for o in llm.generate(TEXTS, params)]
    for want, got in zip(runs["torch"], runs["triton"], strict=True):
        differ = next(
            (i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=False)) if a != b), None
        )
        if differ is not None:  # say whether it was a near-tie
            margin = want.logprobs[differ].top[0][1] - want.logprobs[differ].top[1][1]
            pytest.fail(
                f"step {differ}: {got.token_ids} != {want.token_ids}; torch's top-2 margin {margin:.3f}"
            )
    assert 4 in splits  # the padded decodes (a block table 2048 wide, 3 KV heads, 4 rows) split in four


class HostReads(TorchDispatchMode):
    """The ops that read a device tensor's values back to the host (a scalar, or a shape that depends on them):
    inside a CUDA graph's capture each is an error, and in a replay a value frozen at capture."""

    READS = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.equal.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="interpreter off"))],
)
def test_the_captured_forward_reads_nothing_back_to_the_host(default_layout, backend):
    """What capture runs (the padded decode forward) must size everything from shapes: the Triton backend does;
    the torch backend reads the lengths back, which is why it never captures."""
    kernels = _kernels(backend, "cpu")
    model_dir = Path(default_layout)
    model = build_model(
        decoder_spec(read_config(model_dir)),
        load_weights(model_dir),
        torch.bfloat16,
        torch.device("cpu"),
        kernels,
    )
    runner = ModelRunner(model, 24, BLOCK, torch.device("cpu"), torch.bfloat16)
    runner.enable_decode_graphs(max_num_seqs=4, max_model_len=2048, capture=False)
    _prefill(runner, PROMPTS, TABLES)
    graphs = runner.decode_graphs
    rows = runner._decode_rows(_decode_chunks(0))
    graphs._fill(rows, 4)
    with HostReads() as reads:
        graphs._forward(4)
    assert (reads.seen == []) == (backend == "triton"), reads.seen
