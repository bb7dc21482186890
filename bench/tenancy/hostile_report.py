"""What bench/tenancy/hostile_inputs.py saw, and its markdown table: each attacker request's and the victim's
record, and the cells that report them ("> T s": not done within T seconds)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class Exchange:
    """One attacker request as the client saw it."""

    status: int | None = None  # None: no HTTP answer
    seconds: float = 0.0
    finished: bool = False  # False: cut at the attack's deadline
    error_event: bool = False  # a 200 stream that carried an error event
    bytes_received: int = 0
    error: str | None = None  # the transport's, when there was no answer


@dataclass(slots=True)
class Victim:
    latency: float | None  # None: not done within the timeout
    ttft: float | None = None
    error: str | None = None


def seconds(value: float | None, bound: float) -> str:
    return f"> {bound:g} s" if value is None else f"{value:.2f} s"


def attacker_status(exchanges: list[Exchange]) -> str:
    """`401 x48`, `200`, `200 + error event, cut`: each answer's status, and how many were cut at the deadline."""
    labels = Counter(
        ("no answer" if e.status is None else str(e.status)) + (" + error event" if e.error_event else "")
        for e in exchanges
    )
    parts = [label if n == 1 else f"{label} x{n}" for label, n in sorted(labels.items())]
    cut = sum(not e.finished and e.error is None for e in exchanges)
    if cut:
        parts.append("cut" if len(exchanges) == 1 else f"{cut} cut")
    return ", ".join(parts)


def attacker_time(exchanges: list[Exchange], sequential: bool = False) -> str:
    """One request's time, or the (lower) median and max of many; each in turn, `first, then ...`, for one
    connection's requests sent one after the other; `> x s` where cut at the deadline."""

    def one(e: Exchange) -> str:
        return f"{'> ' if not e.finished and e.error is None else ''}{e.seconds:.2f} s"

    if len(exchanges) == 1:
        return one(exchanges[0])
    if sequential:
        return ", then ".join(one(e) for e in exchanges)
    ordered = sorted(exchanges, key=lambda e: e.seconds)
    return f"median {one(ordered[(len(ordered) - 1) // 2])}, max {one(ordered[-1])}"


def victim_cells(victim: Victim, alone: float, timeout: float) -> tuple[str, str, str]:
    """Latency under attack, its ratio to alone, TTFT; an error is named beside the latency."""
    latency = seconds(victim.latency, timeout)
    if victim.error is not None and victim.latency is not None:
        latency += f" ({victim.error[:60]})"
    ratio = f"> {timeout / alone:.0f}x" if victim.latency is None else f"{victim.latency / alone:.1f}x"
    ttft = "-" if victim.ttft is None else f"{victim.ttft:.2f} s"
    return latency, ratio, ttft


def live_cell(latencies: list[float]) -> str:
    if not latencies:
        return "-"
    return f"max {max(latencies):.2f} s, median {statistics.median(latencies):.3f} s"


def markdown_table(report: dict) -> str:
    """One row a case; its victim alone is the case's own where its victim's request differs (json_schema)."""
    timeout = report["timeout_s"]
    header = [
        "case",
        "hostile input",
        "attacker status",
        "attacker time",
        "victim alone",
        "victim under attack",
        "ratio",
        "victim TTFT",
        "/health/live",
        "quiet again after",
    ]
    rows = [header, ["---"] * len(header)]
    for case in report["cases"]:
        exchanges = [Exchange(**e) for e in case["attacker"]]
        alone = case.get("alone_s") or report["alone_s"]
        latency, ratio, ttft = victim_cells(Victim(**case["victim"]), alone, timeout)
        rows.append(
            [
                case["case"],
                case["description"],
                attacker_status(exchanges),
                attacker_time(exchanges, sequential=case.get("sends", 1) > 1),
                f"{alone:.2f} s",
                latency,
                ratio,
                ttft,
                live_cell(case["live_latencies"]),
                seconds(case["quiet_after"], report["settle_timeout_s"]),
            ]
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
