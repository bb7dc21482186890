"""LoRA adapters as the gateway knows them: from the live executors' registrations (lora_adapters: name -> the
digest of its files), never from a list of its own. A request's `model` names one; its block hashes start from the
tenant's salt and the adapter's identity (shared.block_hash.adapter_salt), and it goes only to executors that serve
that name with that digest (docs/lora.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from shared.block_hash import adapter_salt
from shared.tenant import Tenant


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    digest: str  # of its files, as the executors serving it publish it

    @property
    def identity(self) -> str:
        """What the executors' prefix cache names it by: the same name with other weights shares no block."""
        return f"{self.name}@{self.digest}"


def served_adapters(registrations: Iterable[dict[str, str]]) -> dict[str, Adapter]:
    """Each adapter some live executor serves (registrations: each one's lora_adapters), under the digest most of
    them publish, the least of equals: while an adapter's files change, executors with the old files and the new
    may both live, and one request's block hashes can name only one."""
    counts: Counter[tuple[str, str]] = Counter()
    for adapters in registrations:
        counts.update(adapters.items())
    best: dict[str, Adapter] = {}
    for (name, digest), count in sorted(counts.items()):
        if name not in best or count > counts[(name, best[name].digest)]:
            best[name] = Adapter(name, digest)
    return dict(sorted(best.items()))


def chain_salt(tenant: Tenant, adapter: Adapter | None) -> str | bytes | None:
    """The salt a request's block hash chain starts from: the tenant's, and under an adapter its identity too."""
    return adapter_salt(tenant.cache_salt, adapter.identity if adapter is not None else None)
