"""The LoRA benchmark's two markdown tables: each system's arms against its own base-only arm, and adapter loads."""

from __future__ import annotations

from dataclasses import dataclass

from bench.kv_tiers.workload import ms, ratio
from bench.lora.workload import arm_name

TARGET_ADAPTERS = 8
TARGET_RATIO = 0.8  # issue 50: output tok/s with 8 adapters at least 0.8x base only


@dataclass(frozen=True, slots=True)
class ArmRow:
    system: str
    arm: str
    tokens_per_s: str
    vs_base: str
    ttft_p50: str
    itl_p50: str
    failed: str
    target: str = ""
    met: bool | None = None  # None: no target on this line, or not measured

    def cells(self) -> tuple[str, ...]:
        met = {None: "", True: "yes", False: "**no**"}[self.met]
        return (
            self.system,
            self.arm,
            self.tokens_per_s,
            self.vs_base,
            self.ttft_p50,
            self.itl_p50,
            self.failed,
            self.target,
            met,
        )


ARM_HEADER = (
    "system",
    "arm",
    "output tok/s",
    "vs base only",
    "TTFT p50",
    "ITL p50",
    "failed",
    "target",
    "met",
)
LOAD_HEADER = (
    "system",
    "base TTFT alone",
    "adapter TTFT, first use",
    "adapter TTFT, loaded",
    "load (first use - loaded)",
    "first use - base",
    "probe errors",
)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def arm_rows(system: str, report: dict) -> list[ArmRow]:
    """One row per arm measured, its output tok/s against the same system's base-only arm."""
    arms = report["arms"]
    base = arms.get(arm_name(0), {}).get("summary", {}).get("output_tokens_per_s")
    rows = []
    for name, arm in arms.items():
        summary = arm["summary"]
        rate = summary["output_tokens_per_s"]
        against = ratio(rate, base)
        target = len(arm["adapters"]) == TARGET_ADAPTERS
        rows.append(
            ArmRow(
                system,
                name,
                "-" if rate is None else f"{rate:.1f}",
                "-" if against is None else f"{against:.2f}x",
                _ms(summary["ttft_ms"]["p50"]),
                _ms(summary["itl_ms"]["p50"]),
                f"{summary['failed']} of {summary['completed'] + summary['failed']}",
                f">= {TARGET_RATIO}x" if target else "",
                None if not target or against is None else against >= TARGET_RATIO,
            )
        )
    return rows


def load_row(system: str, load: dict) -> tuple[str, ...]:
    return (
        system,
        ms(load["base_ttft_s"]),
        ms(load["first_use_ttft_s"]),
        ms(load["loaded_ttft_s"]),
        ms(load["load_s"]),
        ms(load["first_use_minus_base_s"]),
        str(len(load["errors"])),
    )


def tables(systems: dict[str, dict]) -> str:
    """Both tables for every system measured (name -> its report from bench.lora.workload.measure)."""
    arms = [row.cells() for name, report in systems.items() for row in arm_rows(name, report)]
    loads = [load_row(name, report["load"]) for name, report in systems.items()]
    return _table(ARM_HEADER, arms) + "\n\n" + _table(LOAD_HEADER, loads)


def _ms(value_ms: float | None) -> str:
    return "-" if value_ms is None else f"{value_ms:,.0f} ms"
