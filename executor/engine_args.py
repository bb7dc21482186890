"""The engine's settings on the command line: vLLM's flag names, parsed into an EngineConfig and written back out
for a child process."""

from __future__ import annotations

import argparse
import dataclasses

from executor.engine_config import (
    ADMISSIONS,
    ATTENTION_BACKENDS,
    KV_OFFLOAD_DISK_BYTES,
    QUANTIZATIONS,
    QUANTIZED_ACTIVATIONS,
    WAITING_STEPS,
    EngineConfig,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="model directory, .gguf file or name (default SmolLM2-135M-Instruct)"
    )
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 4GiB (CPU default 4GiB)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens one step computes at most (default: 2048 on CUDA, 512 on CPU)",
    )
    g.add_argument(
        "--max-waiting-seqs",
        type=int,
        default=d.max_waiting_seqs,
        help="refuse a tenant's new requests as busy while this many of its requests wait unstarted, or 4x this "
        "many of all tenants' (with --no-fair-share: this many of anyone's); likewise for requests waiting for "
        "their structured-outputs grammars to compile (default: %(default)s)",
    )
    g.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=None,
        help=f"refuse a tenant's new requests as busy while its waiting prompts hold this many tokens to "
        f"prefill, or all tenants' 4x this many (default: {WAITING_STEPS} x --max-num-batched-tokens)",
    )
    g.add_argument(
        "--max-waiting-time",
        type=float,
        default=d.max_waiting_time,
        help="seconds a request may wait unstarted before it is handed back to its gateway, which sends it "
        "where it can start (0: never; default: %(default)s)",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout,
        help="seconds one structured-outputs grammar may take to compile before its request is refused "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--grammar-fast-budget",
        type=float,
        default=d.grammar_fast_budget,
        help="seconds every structured-outputs grammar first gets in a compile lane that long compiles never "
        "occupy; one that takes longer compiles in the slow lane, tenants in turns, up to "
        "--grammar-compile-timeout (default: %(default)s)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--fair-share",
        action=argparse.BooleanOptionalAction,
        default=d.fair_share,
        help="tenants share each step's tokens in proportion to their key's weight (default: on)",
    )
    g.add_argument(
        "--kv-shares",
        action=argparse.BooleanOptionalAction,
        default=d.kv_shares,
        help="keep a tenant's cached KV within its share from other tenants' bursts; evict blocks used once "
        "before blocks used again (default: on)",
    )
    g.add_argument(
        "--kv-offload-memory",
        default=None,
        metavar="SIZE",
        help="a host-memory tier below the KV pool, e.g. 8GiB: blocks the pool caches are copied there and loaded "
        "back for a request whose prefix the pool lost (default: 16GiB on CUDA, off on the CPU; 0: off)",
    )
    g.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="DIR",
        help="a disk tier: one file per cached block in DIR (a local NVMe path), indexed again at start, so a "
        "restarted executor serves warm (default: off)",
    )
    g.add_argument(
        "--kv-offload-disk",
        default=None,
        metavar="SIZE",
        help=f"the disk tier's size (default: {KV_OFFLOAD_DISK_BYTES // 2**30}GiB)",
    )
    g.add_argument(
        "--kv-offload-admission",
        default=d.kv_offload_admission,
        choices=ADMISSIONS,
        help="which blocks the pool caches are copied to the tiers: recency (every one; the tiers evict by "
        "recency and shares) or reuse (a block the prefix cache served or that was computed twice: one-off "
        "prompts never take tier room, a history is computed twice before it is kept) (default: %(default)s)",
    )
    g.add_argument(
        "--kv-pull-timeout",
        type=float,
        default=d.kv_pull_timeout,
        help="seconds a pull of a prefix from another executor may take before the request computes it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=d.enable_lora,
        help="serve LoRA adapters beside the base model: a request's model names one (default: off)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve: each a name and a PEFT directory (adapter_config.json, adapter_model.safetensors)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        help="distinct adapters in one step (default: %(default)s)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory, least recently used dropped first (default: --max-loras)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=d.max_lora_rank,
        help="the largest adapter rank accepted (default: %(default)s)",
    )
    g.add_argument("--speculative-model", default=None, help="ngram or a draft model path")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    g.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min)
    g.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max)
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=d.speculative_disable_by_batch_size,
        help="no speculation while more requests than this are running",
    )
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="paged-attention kernels: auto (Triton on CUDA, torch elsewhere), torch or triton",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=d.enforce_eager,
        help="run every step eagerly: no CUDA graphs for decode steps (graphs need the triton backend)",
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=QUANTIZATIONS,
        help="weights quantized at load time: int8 (weight-only, one scale per output row or per "
        "--quantization-group-size inputs), fp8 (e4m3; w8a8 with torch's scaled matmul on Hopper GPUs, "
        "dequantized in the forward elsewhere), none (the float --dtype); auto (default): as the checkpoint holds "
        "them",
    )
    g.add_argument(
        "--quantization-group-size",
        type=int,
        default=d.quantization_group_size,
        help="--quantization int8: inputs of a row sharing one scale, a divisor of every layer's inputs "
        "(default: a scale per output row)",
    )
    g.add_argument(
        "--quantized-activations",
        default=d.quantized_activations,
        choices=QUANTIZED_ACTIVATIONS,
        help="what quantized weights multiply on the CPU: int8 (default; each row's activations in blocks of 32 "
        "with a scale each, multiplied as integers where the CPU has AVX-512 VNNI, as llama.cpp does: 1.5-1.8x "
        "faster, greedy tokens nearer to ties may differ from float32's), int16 (int8 and each block's rounding "
        "error as a second int8, multiplied beside it: the dequantized model's greedy answers, a row's integer "
        "work doubled) or float32 (the weights converted to floats: the dequantized model's results to float32 "
        "rounding)",
    )
    g.add_argument(
        "--adaptive-cpu-threads",
        action=argparse.BooleanOptionalAction,
        default=d.adaptive_cpu_threads,
        help="on the CPU, run the forward pass on one thread fewer while the executor's threads wait for cores "
        "other processes hold, and take it back when a core is idle (default: on); off: always torch's threads",
    )
    g.add_argument("--seed", type=int, default=d.seed)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that recreate config's non-default settings, to pass engine settings on to a child process."""
    default = EngineConfig()
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, *(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
