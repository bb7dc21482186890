"""What the KV tiers count for /metrics (EngineStats' tier fields): prompt tokens not computed by where their KV
came from, bytes each way, pulls and how long they took."""

from __future__ import annotations

from dataclasses import dataclass, field

TIER_NAMES = ("host", "disk")


@dataclass(slots=True)
class TierCounters:
    # of requests that started: tokens loaded from each tier below the pool, or pulled from a peer
    cached_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("host", "disk", "peer"), 0))
    offloaded_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    loaded_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    pulled_bytes: int = 0
    pulls: int = 0
    pulls_failed: int = 0  # pulls that delivered fewer blocks than asked for
    pull_seconds: list[float] = field(default_factory=list)  # each pull's, since the service last took them

    def snapshot(self, tiers: list, rejected_files: int) -> dict[str, int]:
        """EngineStats' tier fields, by name; tiers: the indexes' owners (host, disk) that are on."""
        out = {f"kv_cached_tokens_{source}": n for source, n in self.cached_tokens.items()}
        for name in TIER_NAMES:
            out[f"kv_offloaded_bytes_{name}"] = self.offloaded_bytes[name]
            out[f"kv_loaded_bytes_{name}"] = self.loaded_bytes[name]
        for tier in tiers:
            out[f"kv_{tier.name}_blocks_used"] = tier.index.num_cached_blocks
            out[f"kv_{tier.name}_blocks_total"] = tier.index.num_blocks
        out.update(
            kv_disk_files_rejected=rejected_files,
            kv_pulled_bytes=self.pulled_bytes,
            kv_pulls=self.pulls,
            kv_pulls_failed=self.pulls_failed,
        )
        return out

    def take_pull_seconds(self) -> list[float]:
        out, self.pull_seconds = self.pull_seconds, []
        return out
