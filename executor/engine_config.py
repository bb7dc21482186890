"""Engine settings under vLLM's flag names (their command-line form is executor/engine_args.py)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from executor.kv.tiers.admission import ADMISSIONS
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
MAX_LORA_RANK = 512  # vLLM's largest supported rank
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
    # seconds every grammar first gets in the fast lane, which long compiles never occupy; one that takes longer
    # compiles in the slow lane (tenants in turns, up to grammar_compile_timeout)
    grammar_fast_budget: float = 0.3
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
    # which cached blocks go down to the tiers: every one (recency) or those used twice (reuse; kv/tiers/admission.py)
    kv_offload_admission: str = "recency"
    # LoRA adapters beside the base model (executor/lora/): their names and PEFT directories, how many distinct
    # ones a step may run, how many host memory keeps loaded, and the largest rank accepted
    enable_lora: bool = False
    lora_modules: list[str] | dict[str, str] | None = None  # NAME=PATH each, or name -> path
    max_loras: int = 1
    max_cpu_loras: int | None = None  # None: max_loras
    max_lora_rank: int = 16
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
        self._check_lora()
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
        if not self.grammar_fast_budget > 0:
            raise ValueError(f"grammar_fast_budget must be > 0 seconds, got {self.grammar_fast_budget}")
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
        if self.kv_offload_admission not in ADMISSIONS:
            raise ValueError(
                f"kv_offload_admission must be one of {', '.join(ADMISSIONS)}, got {self.kv_offload_admission!r}"
            )
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

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): a step's "
                "adapters are held in host memory"
            )

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
