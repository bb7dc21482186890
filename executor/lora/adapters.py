"""The adapters an executor serves (--lora-modules NAME=PATH), and those it holds in host memory.

An adapter is known by name from the start: its files' digest is read then, so a request's block hashes can name
it before its weights load. Its weights load on first use and stay while they are among the --max-cpu-loras most
recently used; the least recently used one not running is dropped first.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from executor.lora.adapter_files import (
    TARGETS,
    WEIGHTS_FILE,
    AdapterError,
    LoRAAdapter,
    files_digest,
    load_adapter,
    projection_columns,
    projection_inputs,
    read_config,
)
from executor.models.llama import DecoderSpec
from shared.adapter_names import MAX_RUNTIME_ADAPTERS, check_adapter_name

if TYPE_CHECKING:
    from executor.request import Request

# slack over the largest adapter --max-lora-rank allows, for the safetensors header
HEADER_SLACK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class KnownAdapter:
    name: str
    path: Path
    digest: str

    @property
    def identity(self) -> str:
        """What the prefix cache's chain names: the same name with other weights never shares a block."""
        return f"{self.name}@{self.digest}"


def parse_lora_modules(specs: list[str] | dict[str, str] | None) -> dict[str, str]:
    """NAME=PATH pairs (or a mapping) as name -> path, each name checked."""
    if not specs:
        return {}
    pairs = specs.items() if isinstance(specs, dict) else (_split(s) for s in specs)
    modules: dict[str, str] = {}
    for name, path in pairs:
        check_adapter_name(name)
        if name in modules:
            raise ValueError(f"lora_modules: {name!r} is named twice")
        modules[name] = path
    return modules


def _split(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise ValueError(f"lora_modules: expected NAME=PATH, got {spec!r}")
    return name, path


def max_adapter_bytes(spec: DecoderSpec, max_rank: int) -> int:
    """The file size of the largest adapter the bounds allow: every module at --max-lora-rank in float32."""
    columns, inputs = projection_columns(spec), projection_inputs(spec)
    per_layer = 0
    for projection, part in TARGETS.values():
        start, end = columns[projection][part]
        per_layer += max_rank * (inputs[projection] + end - start) * 4
    return per_layer * spec.num_layers + HEADER_SLACK_BYTES


class Adapters:
    def __init__(
        self,
        modules: dict[str, str],
        spec: DecoderSpec,
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, device
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self.max_bytes = max_adapter_bytes(spec, max_rank)
        self.known: dict[str, KnownAdapter] = {}
        self._held: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        for name, path in modules.items():
            self.register(name, path)
        self.static = set(modules)  # --lora-modules: never dropped by the run-time registry
        # the run-time registry as last synced: name -> path, and those that could not be served: name -> the
        # path tried and why (the path, so that a load of the name from another path never reads this refusal)
        self._runtime: dict[str, str] = {}
        self.refused: dict[str, dict[str, str]] = {}

    def register(self, name: str, path: str | Path) -> KnownAdapter:
        """Check the adapter's config (not yet its weights) and know it by name."""
        check_adapter_name(name)
        path = Path(path)
        read_config(path, self.max_rank)
        if not (path / WEIGHTS_FILE).is_file():
            raise AdapterError(f"{path} has no {WEIGHTS_FILE}")
        if (path / WEIGHTS_FILE).stat().st_size > self.max_bytes:
            raise AdapterError(f"{path / WEIGHTS_FILE} is over the bound of {self.max_bytes} bytes")
        known = KnownAdapter(name, path, files_digest(path))
        self.known[name] = known
        return known

    def sync(self, registry: dict[str, str]) -> bool:
        """Serve the adapters of the run-time registry (name -> path; shared.redis_keys.LORA_ADAPTERS) and drop
        those it no longer names: requests already holding one finish with it, new ones are refused. Each name
        is tried once per path; refused lists why one could not be. Whether anything changed."""
        changed = False
        for name in [n for n in self._runtime if n not in registry]:
            del self._runtime[name]
            self.refused.pop(name, None)
            if name not in self.static:
                self.known.pop(name, None)
                self._held.pop(name, None)
            changed = True
        for name, path in registry.items():
            if self._runtime.get(name) == path:
                continue
            self._runtime[name] = path
            if name not in self.static:  # a new path for the name: its old weights go
                self.known.pop(name, None)
                self._held.pop(name, None)
            self.refused.pop(name, None)
            changed = True
            try:
                if name in self.static:
                    raise AdapterError(
                        f"{name!r} is served from --lora-modules here; unload needs another name"
                    )
                if len(self._runtime) > MAX_RUNTIME_ADAPTERS:
                    raise AdapterError(
                        f"this executor serves at most {MAX_RUNTIME_ADAPTERS} run-time adapters"
                    )
                self.register(name, path)
            except (AdapterError, ValueError, OSError) as error:
                self.refused[name] = {"path": path, "error": str(error)}
        return changed

    def registration(self, max_loras: int) -> dict[str, str | int]:
        """What the executor's registration says (shared.redis_keys): lora_adapters, what it serves (name ->
        digest); lora_refused, which of the run-time registry it cannot serve, from which path and why; max_loras,
        its step slots, for routing to see when other adapters hold them all."""
        return {
            "lora_adapters": json.dumps({k.name: k.digest for k in self.known.values()}),
            "lora_refused": json.dumps(self.refused),
            "max_loras": max_loras,
        }

    def residency(self, running: Iterable[Request]) -> dict[str, str]:
        """The load's adapter fields: those running requests use (a step's slots), those host memory holds."""
        names = sorted({r.lora.name for r in running if r.lora is not None})
        return {"lora_running": ",".join(names), "lora_held": ",".join(self._held)}

    def resolve(self, name: str) -> KnownAdapter:
        known = self.known.get(name)
        if known is None:
            raise ValueError(f"lora: no adapter named {name!r} is loaded here")
        return known

    def held(self, known: KnownAdapter) -> LoRAAdapter | None:
        """The adapter's weights if host memory holds them (now its most recently used)."""
        adapter = self._held.get(known.name)
        if adapter is None or adapter.digest != known.digest:
            return None
        self._held.move_to_end(known.name)
        return adapter

    def load(self, known: KnownAdapter) -> LoRAAdapter:
        """Read and check the adapter's weights, on the device; touches no shared state (a worker runs it)."""
        adapter = load_adapter(known.name, known.path, self.spec, self.max_rank, self.max_bytes, self.dtype)
        if adapter.digest != known.digest:
            raise AdapterError(f"{known.path} changed on disk since it was registered as {known.name!r}")
        for projections in adapter.layers:
            for lora in projections.values():
                lora.a = lora.a.to(self.device)
                lora.parts = [(s, e, b.to(self.device), f) for s, e, b, f in lora.parts]
        return adapter

    def keep(self, adapter: LoRAAdapter, in_use: set[str]) -> None:
        """Hold a loaded adapter; past --max-cpu-loras, drop the least recently used ones not in_use."""
        self._held[adapter.name] = adapter
        self._held.move_to_end(adapter.name)
        for name in list(self._held):
            if len(self._held) <= self.max_cpu_loras:
                break
            if name not in in_use and name != adapter.name:
                del self._held[name]

    @property
    def names_held(self) -> list[str]:
        """The adapters host memory holds, least recently used first."""
        return list(self._held)
