"""gpu_check's JSON as the README's markdown: a line on the device, the kernels' correctness, the decode-attention
table and the end-to-end table, so a GPU session's figures go into the README as measured.

python -m bench.gpu_report gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return lines


def _section_error(report: dict, key: str) -> str | None:
    section = report.get(key)
    if isinstance(section, dict) and "error" in section:
        return f"**{key} failed**: `{section['error']}`"
    return None


def correctness_lines(report: dict) -> list[str]:
    if error := _section_error(report, "correctness"):
        return [error]
    cases = report.get("correctness", [])
    failed = [c for c in cases if not c["ok"]]
    worst: dict[str, float] = {}
    for case in cases:
        worst[case["dtype"]] = max(worst.get(case["dtype"], 0.0), case["max_error"])
    summary = ", ".join(f"{dtype} {error:.1e}" for dtype, error in worst.items())
    lines = [
        f"Kernels against their torch twins on CUDA: {len(cases) - len(failed)} of {len(cases)} cases within "
        f"tolerance; largest error by dtype: {summary}."
    ]
    lines += [f"- failed: {c['kernel']} {c['dtype']}: {c['max_error']:.2e}" for c in failed]
    return lines


def decode_lines(report: dict) -> list[str]:
    if error := _section_error(report, "decode_attention"):
        return [error]
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
    return _table(["shape", "variant", "µs per call", "GB/s", "share of peak", "max error vs SDPA"], rows)


def end_to_end_lines(report: dict) -> list[str]:
    if error := _section_error(report, "end_to_end"):
        return [error]
    rows, notes = [], []
    for r in report.get("end_to_end", []):
        if "error" in r:
            notes.append(f"- {r['backend']} failed: `{r['error']}`")
        elif "skipped" in r:
            notes.append(f"- {r['backend']} at {r['concurrency']}: skipped ({r['skipped']})")
        else:
            rows.append(
                [
                    r["backend"],
                    "yes" if r["cuda_graphs"] else "no",
                    r["concurrency"],
                    r["output_tok_s"],
                    r["seconds"],
                    f"{r['tokens_matching_first_backend']:.0%}",
                ]
            )
    header = [
        "backend",
        "CUDA graphs",
        "concurrent requests",
        "output tok/s",
        "seconds",
        "tokens as first backend",
    ]
    return _table(header, rows) + notes


def render(report: dict) -> str:
    head = (
        f"{report.get('device')} (peak {report.get('peak_gbps')} GB/s), torch {report.get('torch')}, "
        f"triton {report.get('triton')}; the check took {report.get('seconds')} s."
    )
    blocks = [[head], correctness_lines(report), decode_lines(report), end_to_end_lines(report)]
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="gpu_check's --out file")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"error: {args.report}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
