"""The CPU kernels of the per-layer operations (kvkernels/csrc/fused_cpu.cpp) against the torch ops they replace,
on the strided views a fused qkv projection hands them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvkernels import layer_ops, torch_paged, torch_twins
from kvkernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels could not be built here")

HEADS, KV_HEADS, DIM = 9, 3, 64


def qkv_views(tokens: int, seed: int = 0):
    """q [T, Hq, D], k and v [T, Hkv, D] as views of one [T, (Hq + 2 Hkv) D] projection output."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=torch.Generator().manual_seed(seed))
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return q.view(tokens, HEADS, DIM), k.view(tokens, KV_HEADS, DIM), v.view(tokens, KV_HEADS, DIM)


def cos_sin(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)).float()
    freqs = torch.arange(tokens).float()[:, None] * 37 * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rotary_in_place_is_bit_identical_to_the_twin(tokens: int) -> None:
    q, k, _ = qkv_views(tokens)
    cos, sin = cos_sin(tokens)
    expected_q, expected_k = torch_twins.rotary_embedding(q.clone(), k.clone(), cos, sin)
    got_q, got_k = layer_ops.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where the projection wrote it
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_silu_and_mul_is_bit_identical_to_torch(tokens: int) -> None:
    x = torch.randn(tokens, 2 * 1536) * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(layer_ops.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_add_rms_norm_is_bit_identical_to_torch(tokens: int) -> None:
    x, residual, weight = torch.randn(tokens, 576), torch.randn(tokens, 576) * 3, torch.rand(576) + 0.5
    normed, summed = layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, F.rms_norm(x + residual, (576,), weight, 1e-5))


# row lengths through every branch of torch's summation order (kvkernels/csrc/torch_row_sum.h): shorter than a
# vector, vectors but no group of four, groups short of a level, one and two levels of the cascade, a tail of
# vectors and of elements, and past the 32768 from which torch splits a row over threads
@pytest.mark.parametrize("hidden", [3, 10, 20, 48, 100, 576, 960, 1024, 1100, 2048, 4100, 8192, 20003, 33000])
def test_rms_norm_sums_in_torchs_order(hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    # magnitudes over several orders, so that a different order of additions would show in the last bits
    rows = torch.randn(3, hidden, generator=generator) * torch.exp(
        torch.randn(3, hidden, generator=generator) * 3
    )
    residual = torch.randn(3, hidden, generator=generator)
    weight = torch.rand(hidden, generator=generator) + 0.5
    summed = rows + residual
    hf = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert torch.equal(cpu_kernels().rms_norm(summed, weight, 1e-6), hf)
    assert torch.equal(cpu_kernels().add_rms_norm(rows, residual, weight, 1e-6)[0], hf)
    assert torch.equal(F.rms_norm(summed, (hidden,), weight, 1e-6), hf)


def test_each_op_falls_back_to_torch_where_the_kernels_are_off(monkeypatch) -> None:
    monkeypatch.setattr(layer_ops, "cpu_kernels", lambda: None)
    q, k, _ = qkv_views(3)
    cos, sin = cos_sin(3)
    got_q, _ = layer_ops.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() != q.data_ptr()
    x = torch.randn(3, 8)
    assert torch.equal(layer_ops.silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])


@pytest.mark.parametrize("kernel_on", [True, False])
def test_cache_write_from_strided_views_skips_padding(kernel_on: bool, monkeypatch) -> None:
    if not kernel_on:
        monkeypatch.setattr(torch_paged, "cpu_kernels", lambda: None)
    _, k, v = qkv_views(5)
    slots = torch.tensor([3, -1, 40, 17, 0])
    caches = [torch.zeros(4, 16, KV_HEADS, DIM) for _ in range(4)]
    keep = slots >= 0
    torch_twins.reshape_and_cache(k[keep], v[keep], caches[0], caches[1], slots[keep])
    torch_paged.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_cache_write_outside_the_cache_is_an_error() -> None:
    _, k, v = qkv_views(2)
    caches = [torch.zeros(2, 16, KV_HEADS, DIM) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch_paged.reshape_and_cache(k, v, *caches, torch.tensor([1, 32]))


def test_decode_step_reads_a_strided_query_in_one_call() -> None:
    """A step of decodes alone goes straight to the kernel with q still a view of the qkv output."""
    q, _, _ = qkv_views(4, seed=2)
    g = torch.Generator().manual_seed(3)
    key_cache = torch.randn(12, 16, KV_HEADS, DIM, generator=g)
    value_cache = torch.randn(12, 16, KV_HEADS, DIM, generator=g)
    table = torch.randperm(12, generator=g)[:12].view(4, 3).to(torch.int32)
    seq_lens = torch.tensor([1, 16, 33, 48], dtype=torch.int32)
    starts = torch.arange(5, dtype=torch.int32)
    expected = torch_twins.paged_attention(
        q.contiguous(), key_cache, value_cache, table, seq_lens, starts, 0.125
    )
    got = torch_paged.paged_attention(q, key_cache, value_cache, table, seq_lens, starts, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_engine_gives_the_same_logits_and_tokens_with_the_kernels_and_without(
    family, tiny_models, monkeypatch
):
    """The whole model on the C++ kernels against the torch ops they replaced: prefill and decode logits within
    fp32 tolerance, greedy tokens identical (HF equivalence itself is tests/executor/test_hf_equivalence.py)."""
    from executor import LLM, SamplingParams
    from executor.model_runner import ModelRunner

    logits: dict[bool, list[torch.Tensor]] = {}
    tokens: dict[bool, list[list[int]]] = {}
    real_run = ModelRunner.run
    for kernels_on in (True, False):
        if not kernels_on:
            for module in (layer_ops, torch_paged):
                monkeypatch.setattr(module, "cpu_kernels", lambda: None)
        seen: list[torch.Tensor] = []

        def recording_run(self, chunks, seen=seen):
            seen.append(real_run(self, chunks))
            return seen[-1]

        monkeypatch.setattr(ModelRunner, "run", recording_run)
        llm = LLM(tiny_models[family], kv_cache_memory="8MiB", max_num_batched_tokens=32)
        prompts = [[5, 9, 2, 7, 1, 3] * 4, [11, 4, 8], list(range(3, 40))]
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        tokens[kernels_on] = [o.outputs[0].token_ids for o in outs]
        logits[kernels_on] = seen
    assert tokens[True] == tokens[False]
    assert len(logits[True]) == len(logits[False])
    for fused, plain in zip(logits[True], logits[False], strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)  # attention sums in another order
