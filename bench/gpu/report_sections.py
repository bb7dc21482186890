"""A check.py report's sections as markdown: a table or a few lines each, in the order SECTION_LINES gives, for
bench/gpu/report.py's session report and the README.

Standard library only, as report.py: it must render what came back even where the session's imports failed.
"""

from __future__ import annotations

# --quantization values under which the weights are the checkpoint's own
UNQUANTIZED = ("auto", "none")


def quantized_label(row: dict) -> str:
    quantization = row.get("quantization", "auto")
    return "" if quantization in UNQUANTIZED else f" ({quantization})"


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return lines


def _section_error(report: dict, key: str) -> list[str]:
    error = report.get("errors", {}).get(key)
    return [] if error is None else [f"**{key} failed**: `{error['error']}`"]


def correctness_lines(report: dict) -> list[str]:
    cases = report.get("correctness", [])
    failed = [c for c in cases if not c["ok"]]
    worst: dict[str, float] = {}
    for case in cases:
        if "max_error" in case:
            worst[case["dtype"]] = max(worst.get(case["dtype"], 0.0), case["max_error"])
    summary = ", ".join(f"{dtype} {error:.1e}" for dtype, error in worst.items())
    lines = [
        f"Kernels against their torch twins: {len(cases) - len(failed)} of {len(cases)} cases within "
        f"tolerance; largest error by dtype: {summary}."
    ]
    for case in failed:
        what = f"`{case['error']}`" if "error" in case else f"{case['max_error']:.2e}"
        lines.append(f"- failed: {case['kernel']} {case['dtype']}: {what}")
    return lines + _section_error(report, "correctness")


def decode_lines(report: dict) -> list[str]:
    rows = [
        [
            r["shape"],
            r["variant"],
            r["us_per_call"],
            r["achieved_gbps"],
            "" if r["share_of_peak"] is None else f"{r['share_of_peak']:.0%}",
            f"{r['max_error_vs_sdpa']:.1e}",
        ]
        for r in report.get("decode_attention", [])
    ]
    header = ["shape", "variant", "µs per call", "GB/s", "share of peak", "max error vs SDPA"]
    return _table(header, rows) + _section_error(report, "decode_attention")


def _engine_lines(report: dict, key: str, header: list[str], cells) -> list[str]:
    rows, lines = [], []
    for r in report.get(key, []):
        who = r.get("backend", "engine") + (f" at {r['concurrency']}" if "concurrency" in r else "")
        if "error" in r:
            lines.append(f"- {who} failed: `{r['error']}`")
        elif "skipped" in r:
            lines.append(f"- {who}: skipped ({r['skipped']})")
        else:
            rows.append(cells(r))
    return (_table(header, rows) if rows else []) + lines + _section_error(report, key)


def agreement_lines(report: dict) -> list[str]:
    header = [
        "backend",
        "dtype",
        "CUDA graphs",
        "concurrent requests",
        "output tokens",
        "tokens as first backend",
        "sequences parted (at near ties)",
        "widest parting, nats",
    ]

    def cells(r: dict) -> list[object]:
        graphs = "yes" if r["cuda_graphs"] else "no"
        return [
            r["backend"],
            r.get("dtype"),
            graphs,
            r["concurrency"],
            r["output_tokens"],
            f"{r['tokens_matching_first_backend']:.0%}",
            f"{r.get('sequences_parted')} ({r.get('parted_at_near_ties')})",
            r.get("widest_parting_nats"),
        ]

    lines = _engine_lines(report, "end_to_end", header, cells)
    return [
        "Greedy tokens by backend: where a sequence parts from the first backend's, the first's top two tokens "
        "must have been a near tie there (judged in float32 without quantization; the other rows are reported):",
        *lines,
    ]


def profiling_lines(report: dict) -> list[str]:
    lines = []
    for r in report.get("profiling", []):
        started = "Started without --kv-cache-memory" + quantized_label(r)
        if "kv_blocks" in r:
            weights = f"{r['weight_bytes'] / 2**20:.0f} MiB of weights, " if "weight_bytes" in r else ""
            lines.append(
                f"{started} ({r['backend']}, CUDA graphs {'on' if r['cuda_graphs'] else 'off'}, "
                f"{r['engine_start_s']} s): {weights}{r['kv_blocks']} KV blocks of {r['block_size']} tokens; "
                f"`{r['profiling_log']}`; served {r['output_tokens']} tokens."
            )
        elif "error" in r:
            lines.append(f"{started}: failed, `{r['error']}`")
        elif "skipped" in r:
            lines.append(f"{started}: skipped ({r['skipped']}).")
    return lines + _section_error(report, "profiling")


def throughput_lines(report: dict) -> list[str]:
    header = ["backend", "CUDA graphs", "concurrent requests", "output tok/s", "seconds", "engine start s"]

    def cells(r: dict) -> list[object]:
        graphs = "yes" if r["cuda_graphs"] else "no"
        return [r["backend"], graphs, r["concurrency"], r["output_tok_s"], r["seconds"], r["engine_start_s"]]

    return _engine_lines(report, "throughput", header, cells)


def adapter_lines(report: dict) -> list[str]:
    header = [
        "LoRA adapters",
        "concurrent requests",
        "CUDA graphs",
        "output tok/s",
        "of base only",
        "seconds",
    ]

    def cells(r: dict) -> list[object]:
        graphs = "yes" if r["cuda_graphs"] else "no"
        who = f"{r['adapters']} of rank {r['rank']}" if r["adapters"] else "base only"
        return [who, r["concurrency"], graphs, r["output_tok_s"], r["of_base"], r["seconds"]]

    return _engine_lines(report, "adapters", header, cells)


def kv_tiers_lines(report: dict) -> list[str]:
    section, lines = report.get("kv_tiers", {}), []
    if "skipped" in section:
        lines.append(f"KV host tier: skipped ({section['skipped']}).")
    if bandwidth := section.get("bandwidth"):
        lines.append(
            f"KV host tier copies of {bandwidth['blocks']} blocks of {section['block_bytes'] / 2**10:.0f} KiB "
            f"({section['dtype']}, {section['device']}), the median of each:"
        )
        rows = [[r["direction"], r["path"], r["gbps"], r["ms"]] for r in bandwidth["rows"]]
        lines += _table(["direction", "path", "GB/s", "ms"], rows)
    revisit = section.get("revisit", {})
    if trials := revisit.get("trials"):
        judged = "judged" if revisit["tokens_judged"] else "judged in float32 alone"
        lines.append(
            f"A revisited {revisit['prompt_tokens']}-token prompt, its prefix loaded from the host tier: TTFT "
            f"{revisit['revisit_ttft_ms']} ms against {revisit['recompute_ttft_ms']} ms recomputed "
            f"({revisit['revisit_over_recompute']}x), the median of {len(trials)} trials; prefix tokens from the "
            f"host tier: {', '.join(str(t['revisit_cached_tokens_host']) for t in trials)} of "
            f"{revisit['expected_cached_tokens']}; loaded blocks as first computed: "
            f"{sum(t['blocks_identical'] for t in trials)} of {sum(t['blocks_compared'] for t in trials)}; greedy "
            f"tokens as the first visit's: {', '.join(t['tokens'] for t in trials)} ({judged})."
        )
    return lines + _section_error(report, "kv_tiers")


SECTION_LINES = {
    "correctness": correctness_lines,
    "end_to_end": agreement_lines,
    "profiling": profiling_lines,
    "decode_attention": decode_lines,
    "throughput": throughput_lines,
    "adapters": adapter_lines,
    "kv_tiers": kv_tiers_lines,
}


def render(report: dict) -> str:
    """A check.py report (or several merged): a line on the device, then each section it holds."""
    peak = "" if report.get("peak_gbps") is None else f" (peak {report['peak_gbps']} GB/s)"
    head = f"{report.get('device')}{peak}, torch {report.get('torch')}, triton {report.get('triton')}."
    blocks = [[head]]
    blocks += [
        lines(report)
        for key, lines in SECTION_LINES.items()
        if key in report or key in report.get("errors", {})
    ]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"
