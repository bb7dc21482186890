"""A LoRA adapter read from a PEFT directory (adapter_config.json and adapter_model.safetensors), checked against
the base model it is to run on, and laid out for the model's stacked projections.

PEFT names each low-rank pair after the checkpoint's module (`...layers.3.self_attn.q_proj.lora_A.weight`, rank x
inputs, and `lora_B.weight`, outputs x rank). The model stacks q/k/v and gate/up into one GEMM each
(models/llama.py's FUSED_PROJECTIONS), so an adapter's A matrices of one stacked projection are stacked too: one
shrink per projection for every part it targets, then an expand per part into that part's output columns. The
scale (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B at load.

Everything a client or an operator could get wrong is an AdapterError naming it: a missing file, an unsupported
PEFT option, a rank over --max-lora-rank, a module the model does not have, a tensor of the wrong shape, too many
bytes. Nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from executor.models.llama import FUSED_PROJECTIONS, part_rows

if TYPE_CHECKING:
    from executor.models.llama import DecoderSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
UNSTACKED_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")  # the model's projections that stack nothing
# a checkpoint module -> (the model's projection it runs in, its place among that projection's stacked parts)
TARGETS = {
    part.rsplit(".", 1)[1]: (fused, i)
    for fused, parts in FUSED_PROJECTIONS.items()
    for i, part in enumerate(parts)
} | {projection.rsplit(".", 1)[1]: (projection, 0) for projection in UNSTACKED_PROJECTIONS}
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.default)?\.weight"
)
# PEFT options that change what the adapter computes beyond W + scale * B @ A: refused, never ignored
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "modules_to_save": "modules_to_save (full copies of other modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


class AdapterError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass(slots=True)
class ProjectionLoRA:
    """One stacked projection's share of an adapter in one layer."""

    a: torch.Tensor  # [parts x rank, inputs]: every targeted part's A, stacked
    # per targeted part: (first output column, last + 1, its B scaled and transposed [rank, columns], first row
    # of its A in a): the expand walks B^T's rows, each a run of output columns
    parts: list[tuple[int, int, torch.Tensor, int]]


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    digest: (
        str  # of the files' bytes: what the prefix cache's chain names, so a changed adapter never matches
    )
    modules: tuple[str, ...]  # the checkpoint modules it targets
    layers: list[dict[str, ProjectionLoRA]] = field(default_factory=list)  # per layer: projection -> its LoRA
    nbytes: int = 0

    @property
    def identity(self) -> str:
        """What the prefix cache's chain names (shared/block_hash.py adapter_salt)."""
        return f"{self.name}@{self.digest}"


def files_digest(path: Path, weights: bytes | None = None) -> str:
    """The adapter's identity in the prefix cache: its files' bytes, so the same name with other weights differs
    (weights: the weights file's bytes, when the caller has read them already)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((path / CONFIG_FILE).read_bytes())
    digest.update((path / WEIGHTS_FILE).read_bytes() if weights is None else weights)
    return digest.hexdigest()


def projection_columns(spec: DecoderSpec) -> dict[str, list[tuple[int, int]]]:
    """Each projection's parts (models/llama.py's FUSED_PROJECTIONS, in order), as output column ranges."""
    rows = part_rows(spec)
    columns = {projection: [(0, spec.hidden_size)] for projection in UNSTACKED_PROJECTIONS}
    for fused, parts in FUSED_PROJECTIONS.items():
        ends = list(itertools.accumulate(rows[part] for part in parts))
        columns[fused] = list(zip([0, *ends[:-1]], ends, strict=True))
    return columns


def projection_inputs(spec: DecoderSpec) -> dict[str, int]:
    return {
        "self_attn.qkv_proj": spec.hidden_size,
        "self_attn.o_proj": spec.num_heads * spec.head_dim,
        "mlp.gate_up_proj": spec.hidden_size,
        "mlp.down_proj": spec.intermediate_size,
    }


def read_config(path: Path, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scale, target modules) from adapter_config.json."""
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter: it has no {CONFIG_FILE}")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{config_file} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{config_file} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for option, what in _UNSUPPORTED.items():
        if config.get(option):
            raise AdapterError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases (bias={config.get('bias')!r}) are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [t for t in TARGETS if re.fullmatch(targets, t) or targets == t]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: target_modules must be a list of module names, got {targets!r}")
    unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
    if unknown:
        raise AdapterError(f"{path}: cannot adapt {', '.join(unknown)}; kvserve adapts {', '.join(TARGETS)}")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, float(scale), {t.rsplit(".", 1)[-1] for t in targets}


def load_adapter(
    name: str, path: str | Path, spec: DecoderSpec, max_rank: int, max_bytes: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter at path, checked against spec, its weights in dtype on the CPU."""
    path = Path(path)
    rank, scale, modules = read_config(path, max_rank)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}")
    if weights_file.stat().st_size > max_bytes:
        raise AdapterError(
            f"{weights_file} holds {weights_file.stat().st_size} bytes, over the bound of {max_bytes}"
        )
    data = weights_file.read_bytes()  # once: for its digest and its tensors
    digest = files_digest(path, data)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = load_safetensors(data)
    except (RuntimeError, SafetensorError) as error:  # a truncated or foreign file
        raise AdapterError(f"{weights_file} cannot be read: {error}") from None
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"{weights_file}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        layer, module = int(match["layer"]), match["module"]
        if module not in modules:
            raise AdapterError(f"{weights_file}: {key!r} adapts {module}, not in target_modules")
        if layer >= spec.num_layers:
            raise AdapterError(
                f"{weights_file}: {key!r} names layer {layer}; the model has {spec.num_layers}"
            )
        pairs.setdefault((layer, module), {})[match["ab"]] = tensor
    if not pairs:
        raise AdapterError(f"{weights_file} holds no LoRA weights")
    adapter = LoRAAdapter(name, str(path), rank, digest, tuple(sorted(modules)))
    adapter.layers = [{} for _ in range(spec.num_layers)]
    columns, inputs = projection_columns(spec), projection_inputs(spec)
    stacked: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{weights_file}: layer {layer}'s {module} lacks its {missing} weight")
        projection, part = TARGETS[module]
        start, end = columns[projection][part]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, inputs[projection]) or tuple(b.shape) != (end - start, rank):
            raise AdapterError(
                f"{weights_file}: layer {layer}'s {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; rank {rank} on this model needs {(rank, inputs[projection])} and "
                f"{(end - start, rank)}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{weights_file}: layer {layer}'s {module} holds NaN or infinite values")
        stacked.setdefault((layer, projection), []).append((part, a, b))
    for (layer, projection), parts in stacked.items():
        a = torch.cat([a for _, a, _ in parts]).to(dtype).contiguous()
        laid = []
        for i, (part, _, b) in enumerate(parts):
            start, end = columns[projection][part]
            laid.append((start, end, (b.double() * scale).to(dtype).T.contiguous(), i * rank))
        adapter.layers[layer][projection] = ProjectionLoRA(a, laid)
        adapter.nbytes += a.nbytes + sum(b.nbytes for _, _, b, _ in laid)
    return adapter
