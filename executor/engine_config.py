"""Engine settings under vLLM's flag names, and their command-line form."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

from shared.defaults import DEFAULT_BLOCK_SIZE

ATTENTION_BACKENDS = ("auto", "torch", "triton")
# --quantization (kvkernels/weight_quantization.py): auto serves the checkpoint's weights as they are
QUANTIZATIONS = ("auto", "none", "int8", "fp8")
QUANTIZED_ACTIVATIONS = ("int8", "int16", "float32")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "tb": 1000**4,
}


def parse_bytes(value: str | int | float, name: str = "kv_cache_memory") -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes; name is the setting, for the error."""
    if isinstance(value, int | float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot read {value!r} as a size (e.g. 4GiB, 512MB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# A step's token budget when none is given. On a GPU a 2,048-token step takes milliseconds. On a CPU it takes
# seconds (~4 s for SmolLM2-135M on two cores): a burst of prompts then got its first tokens only when the whole
# step ended, and every stream already decoding stalled as long. At 512 a step stays near one second and the
# first prompts of a burst start decoding while the rest prefill; throughput is the same (bench/offline/step_profile.py).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 2048, "cpu": 512}
# The host tier's size when none is given. On CUDA the pool is device memory and host memory is many times larger: a
# tier there keeps what the pool evicts at a memcpy's cost. On the CPU the pool is host memory already: a tier
# would hold the same bytes twice, so it is off unless asked for (it still pays where the pool must stay small).
KV_OFFLOAD_DEFAULT_BYTES = {"cuda": 16 * 2**30, "cpu": 0}
KV_OFFLOAD_DISK_BYTES = 10 * 2**30  # the disk tier's size when only its directory is given
# a request refused by a full executor waits at the gateway for whichever executor frees first; one queued
# at an executor waits for that one alone. So an executor queues about this many steps' prefill, no more
WAITING_STEPS = 4


@dataclass
class EngineConfig:
    model: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None  # bytes; CPU default 4GiB
    max_num_seqs: int = 256
    # back-pressure: an executor refuses a tenant's new requests (the gateway sends them elsewhere or holds them)
    # while this many of the tenant's wait unstarted, or while its waiting prompts hold this many tokens still to
    # prefill; all tenants together, TENANTS_SHARE times that (executor/scheduling/waiting_queue.py)
    max_waiting_seqs: int = 16
    max_waiting_tokens: int | None = None  # None: WAITING_STEPS steps' token budget
    # a request that has waited this long without starting is handed back to its gateway to go elsewhere (0: never)
    max_waiting_time: float = 10.0
    # structured outputs: seconds one grammar may take to compile before its process is killed and its request
    # refused (a regex's compile time grows with the square of its length)
    grammar_compile_timeout: float = 10.0
    # tokens a step computes at most; None: DEFAULT_MAX_NUM_BATCHED_TOKENS for the device (resolved)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # tenants take the engine's tokens in proportion to their weights, a burst waiting behind itself
    # (executor/scheduling/fair_share.py); off: one first-come-first-served queue for all
    fair_share: bool = True
    # a tenant's cached KV blocks within its share of the pool are not evicted for another tenant's requests, and
    # blocks used once go before blocks used again (executor/kv/block_pool.py); off: one LRU for all
    kv_shares: bool = True
    # KV tiers below the pool (executor/kv/tiers/): host memory (None: the device's default, KV_OFFLOAD_DEFAULT_BYTES;
    # 0: off), a directory of block files that outlives the process and its size (None: KV_OFFLOAD_DISK_BYTES), and
    # how long a pull of a prefix from another executor may take before the request computes it instead
    kv_offload_memory: int | str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk: int | str | None = None
    kv_pull_timeout: float = 5.0
    speculative_model: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # speculation pauses while more requests than this are running (spec_decode/backoff.py)
    speculative_disable_by_batch_size: int = 4
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    attention_backend: str = "auto"  # triton on CUDA, torch elsewhere (kvkernels/backend.py)
    enforce_eager: bool = False  # no CUDA graphs for decode steps (executor/cuda_graphs.py)
    # weights quantized at load time (kvkernels/weight_quantization.py): none, int8, fp8; auto: as the checkpoint has them
    quantization: str = "auto"
    quantization_group_size: int | None = (
        None  # int8: inputs sharing a scale (None: one scale per output row)
    )
    # what quantized weights multiply on the CPU (kvkernels/csrc/int8_dot_kernel.h): int8, int16 or float32
    quantized_activations: str = "int8"
    # on the CPU, run the forward pass on fewer threads while other processes take cores (executor/cpu_threads.py)
    adaptive_cpu_threads: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
        self._check_tiers()
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting_seqs",
            "max_waiting_tokens",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.max_waiting_time >= 0:
            raise ValueError(f"max_waiting_time must be >= 0 seconds, got {self.max_waiting_time}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        self._check_quantization()
        self._check_speculative()

    def resolved(self, device_type: str, max_model_len: int) -> EngineConfig:
        """This config with the step's token budget decided, the one place it is: --max-num-batched-tokens or
        the device's default, and at least a whole prompt (max_model_len) without chunked prefill; the waiting
        queue's token bound, when not given, WAITING_STEPS budgets (before a whole prompt raised it)."""
        budget = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(
            device_type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
        )
        waiting_tokens = self.max_waiting_tokens or WAITING_STEPS * budget
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return dataclasses.replace(self, max_num_batched_tokens=budget, max_waiting_tokens=waiting_tokens)

    def _check_quantization(self) -> None:
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(
                f"quantized_activations must be one of {', '.join(QUANTIZED_ACTIVATIONS)}, "
                f"got {self.quantized_activations!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization_group_size is not None:
            if self.quantization != "int8":
                raise ValueError(
                    f"quantization_group_size applies to quantization int8, not {self.quantization!r}"
                )
            if self.quantization_group_size < 1:
                raise ValueError(
                    f"quantization_group_size must be at least 1, got {self.quantization_group_size}"
                )

    def _check_tiers(self) -> None:
        for name in ("kv_offload_memory", "kv_offload_disk"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_bytes(getattr(self, name), name))
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be a size >= 0, got {getattr(self, name)}")
        if self.kv_offload_disk is not None and not self.kv_offload_dir:
            raise ValueError("kv_offload_disk sizes the disk tier: give its directory too (kv_offload_dir)")
        if not self.kv_pull_timeout >= 0:
            raise ValueError(f"kv_pull_timeout must be >= 0 seconds, got {self.kv_pull_timeout}")
        tiers = self.kv_offload_dir or self.kv_offload_memory
        if tiers and self.speculative_model not in (None, "ngram"):
            # a draft model's KV mirrors the target's block for block; the tiers keep the target's alone
            raise ValueError(
                "kv_offload_memory / kv_offload_dir cannot be combined with a draft speculative_model"
            )

    def offload_bytes(self, device_type: str) -> int:
        """The host tier's size: as given, else the device's default (off on the CPU, whose pool is host memory)."""
        if self.kv_offload_memory is not None:
            return int(self.kv_offload_memory)
        return KV_OFFLOAD_DEFAULT_BYTES.get(device_type, 0)

    def _check_speculative(self) -> None:
        if self.speculative_model is None:
            return
        if not isinstance(self.speculative_model, str) or not self.speculative_model:
            raise ValueError(
                f"speculative_model must be 'ngram' or a model path, got {self.speculative_model!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1 with speculative_model, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be at least 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_disable_by_batch_size must be at least 1, got {self.speculative_disable_by_batch_size}"
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
        "--kv-pull-timeout",
        type=float,
        default=d.kv_pull_timeout,
        help="seconds a pull of a prefix from another executor may take before the request computes it "
        "(default: %(default)s)",
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
        else:
            argv += [flag, str(value)]
    return argv
