"""A GGUF's quantized blocks served as they are: each block type converts into QuantizedWeight without changing a
single bit of what gguf.quants dequantizes, and a GGUF model serves those blocks under --quantization auto."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from executor import LLM, SamplingParams
from executor.kv.sizing import weight_bytes
from executor.models.gguf_quantized import load_blocks, quantized_weight
from executor.models.model_files import default_gguf, resolve_model
from executor.models.quantized import stack
from kvkernels.cpu_extension import cpu_kernels
from kvkernels.quantized import ACTIVATION_PLANES, QuantizedLinear, QuantizedWeight
from kvkernels.weight_quantization import TiedEmbedding
from shared.model_paths import GGUF_BLOCKS
from tests.executor.models.test_model_files import gguf_config, write_gguf

Q = GGMLQuantizationType
QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf.quants can write these
# gguf.quants reads these only: random blocks with sane float16 factors (the byte offsets of d and dmin)
READ_ONLY = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def random_blocks(qtype: GGMLQuantizationType, rows: int, inputs: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return quantize(rng.standard_normal((rows, inputs)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * inputs // block_size, type_size), dtype=np.uint8)
    for at in READ_ONLY[qtype]:
        factor = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = factor.view(np.uint8)
    return blocks.reshape(rows, -1)


def assert_bitwise(weight: QuantizedWeight, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    ours, theirs = weight.dequantize().numpy(), dequantize(data, qtype)
    assert ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *READ_ONLY], ids=lambda q: q.name)
def test_blocks_dequantize_bit_for_bit_as_gguf(qtype: GGMLQuantizationType) -> None:
    data = random_blocks(qtype, 6, 512)
    weight = quantized_weight(data, qtype)
    assert_bitwise(weight, data, qtype)
    # 4 bits: -8..7, or 0..15 where an offset places them
    low, high = {8: (-128, 127), 4: (-8, 7) if weight.offsets is None else (0, 15)}[weight.bits]
    assert (
        weight.values.shape == (6, 512)
        and low <= int(weight.values.min()) <= int(weight.values.max()) <= high
    )
    assert weight.group_size == (16 if qtype == Q.Q6_K else 32)


def test_default_gguf_tensors_convert_bit_for_bit() -> None:
    reader = GGUFReader(default_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        data = tensor.data[:2048]  # the embedding's first rows: a second's work, not ten
        assert_bitwise(quantized_weight(data, tensor.tensor_type), data, tensor.tensor_type)
    assert (tensors["blk.0.attn_q.weight"].tensor_type, tensors["token_embd.weight"].tensor_type) == (
        Q.Q4_1,
        Q.Q8_0,
    )


def test_default_model_blocks_equal_its_float_weights(default_model: str) -> None:
    """Rows included: llama.cpp's rotary permutation of q and k is undone in the blocks as in the floats."""
    blocks = load_blocks(Path(default_model) / GGUF_BLOCKS)
    assert len(blocks) == 1 + 30 * 7  # the tied embedding and every projection
    with safe_open(Path(default_model) / "model.safetensors", framework="pt") as floats:
        for name in [n for n in blocks if n.startswith(("model.layers.0.", "model.layers.29."))]:
            assert torch.equal(blocks[name].dequantize(), floats.get_tensor(name)), name


def test_stacking_different_layouts_keeps_every_value() -> None:
    """A Q4_K_M file's q/k are Q4_K (groups of 32, offsets) and its v Q6_K (groups of 16, 8 bits)."""
    parts = [quantized_weight(random_blocks(q, 8, 256, seed), q) for seed, q in enumerate([Q.Q4_K, Q.Q6_K])]
    stacked = stack(parts)
    assert (stacked.group_size, stacked.bits, stacked.offsets is not None) == (16, 8, True)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    floats = stack([parts[0], parts[1].dequantize()])
    assert isinstance(floats, torch.Tensor) and torch.equal(floats, stacked.dequantize())
    layer, x = QuantizedLinear(stacked), torch.randn(3, 256)
    if (ops := cpu_kernels()) is not None:
        layer.pack(ops)  # the CPU kernel's panels serve this layout too
    # float32 sums in any order are within K * 2^-24 * sum |x w| of the exact product
    exact, scale = x.double() @ floats.double().T, x.double().abs() @ floats.double().abs().T
    assert ((layer(x).double() - exact).abs() <= 256 * 2**-24 * scale).all()


def modules(llm: LLM, kind: type) -> list[torch.nn.Module]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head and permuted q/k; tied, with qkv bias
def test_quantized_gguf_serves_its_blocks(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = gguf_config(arch)
    config.initializer_range = 0.4  # peaked logits: the greedy comparison should not hinge on near-ties
    model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(config).eval()
    if arch == "qwen2":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)
    path = write_gguf(tmp_path / "tiny.gguf", model, arch, Q.Q8_0)
    model_dir = str(resolve_model(str(path)))
    served = LLM(model_dir, kv_cache_memory="8MiB", max_model_len=128)
    float32 = LLM(model_dir, kv_cache_memory="8MiB", max_model_len=128, quantization="none")
    # each layer's four, the LM head, and an untied embedding's own table
    tables = 1 + (not config.tie_word_embeddings)
    assert len(modules(served, QuantizedLinear)) == 4 * config.num_hidden_layers + tables
    assert len(modules(served, TiedEmbedding)) == 1 and not modules(float32, QuantizedLinear)
    prompts = [[5, 6, 7], list(range(40, 90))]
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] for llm in (served, float32)]
    if modules(served, QuantizedLinear)[0]._panels.activation_planes == 1:
        # the blocks are the float32 weights exactly, but the activations are rounded to int8 for the integer
        # products (about 0.4% of a block's largest): a random model's greedy path parts from float32's after a
        # few tokens, where a wrong block would part at once
        print("greedy tokens:", tokens)
        assert all(ours[:4] == theirs[:4] for ours, theirs in zip(*tokens, strict=True))
    else:
        assert tokens[0] == tokens[1]
    assert weight_bytes(served.engine.runner.model) < weight_bytes(float32.engine.runner.model) / 2


def test_directory_converted_without_blocks_gets_them_at_the_next_pull(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(gguf_config("llama")), "llama", Q.Q4_0)
    model_dir = resolve_model(str(path))
    first = load_blocks(model_dir / GGUF_BLOCKS)
    shutil.rmtree((model_dir / GGUF_BLOCKS).parent)
    assert resolve_model(str(path)) == model_dir
    again = load_blocks(model_dir / GGUF_BLOCKS)
    assert first.keys() == again.keys() and len(first) == 2 * 7 + 2  # and the untied embedding and head
    assert all(torch.equal(first[n].values, again[n].values) for n in first)


def test_default_model_serves_quantized(default_model: str) -> None:
    # float32 activations: the dequantized model's answer. Under int8 activations the first token is a near-tie
    # ("The" -1.88 against "L" -1.97 in float32) that tips to "L'Étoile, la Marseillaise", as llama.cpp's
    # llama-server answers on the same file
    llm = LLM(default_model, kv_cache_memory="64MiB", max_model_len=512, quantized_activations="float32")
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    text = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    assert "Paris" in text
    assert len(modules(llm, QuantizedLinear)) == 4 * 30 + 1  # the tied LM head is the embedding's table
    assert not any(
        m._panels.activation_planes for m in modules(llm, QuantizedLinear) if m._panels is not None
    )
    with safe_open(Path(default_model) / "model.safetensors", framework="pt") as floats:
        float_bytes = sum(4 * math.prod(floats.get_slice(n).get_shape()) for n in floats.keys())  # noqa: SIM118
    blocks = load_blocks(Path(default_model) / GGUF_BLOCKS)
    assert {w.bits for w in blocks.values()} == {4, 8}
    assert (
        sum(w.nbytes for w in blocks.values()) < float_bytes / 4
    )  # Q4_1 and a Q8_0 table: ~5.4 bits a weight
    assert (
        weight_bytes(llm.engine.runner.model) < float_bytes / 3
    )  # as held: 4-bit values in bytes without panels


def test_int16_activations_answer_as_the_dequantized_model(default_model: str) -> None:
    """Issue 47: int8 activations round each GEMM's input by about 1% (a step of 1/127 of each block's largest),
    which tipped near-tie answers, the README's example among them ("L'Étoile, la Marseillaise"); int16 ones hold
    the products to about 16 bits and answer as float32 activations do. Where the CPU has no AVX-512 VNNI both run
    the float path and agree trivially."""
    questions = [
        "What is the capital of France?",
        "What is the capital of Japan?",
        "Who wrote Romeo and Juliet?",
        "What is the largest planet in our solar system?",
        "Why is the sky blue?",
        "Write a haiku about the sea.",
    ]
    replies = {}
    for activations in ("float32", "int16"):
        llm = LLM(
            default_model, kv_cache_memory="64MiB", max_model_len=512, quantized_activations=activations
        )
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for q in questions
        ]
        vnni = cpu_kernels() is not None and cpu_kernels().int8_dot_available()
        planes = {m._panels.activation_planes for m in modules(llm, QuantizedLinear) if m._panels is not None}
        assert planes <= {ACTIVATION_PLANES[activations] if vnni else 0}  # empty without the kernels
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
        replies[activations] = [o.outputs[0].text for o in outs]
        del llm
    assert "Paris" in replies["int16"][0]
    assert replies["int16"] == replies["float32"]
