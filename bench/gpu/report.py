"""A GPU session's results as the README's markdown, and the judge of them: what failed (problems) and what
was skipped or measured in passing (notes), for check.py's exit status and session.sh's summary line.

python -m bench.gpu.report kernels.json          # one check.py report
python -m bench.gpu.report OUT_DIR               # a session.sh run: every stage's file there, the missing named
python -m bench.gpu.report --note STAGE OUT_DIR  # the few words the summary line puts after a stage's verdict

Standard library only: it must render what came back even where the session's imports failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from bench.gpu.report_sections import quantized_label, render

# what each stage of session.sh leaves in $OUT; "model" leaves its verdict in the summary alone
STAGE_FILES = {
    "env": "env.json",
    "kernels": "kernels.json",
    "tests": "tests.xml",
    "e2e": "e2e.json",
    "figures": "figures.json",
    "kv_tiers": "figures.json",
}
# stages whose results are a section of another stage's file: a device call brings back 8 files, and the session
# leaves 8 (bench/gpu/kv_tiers.py writes its section into figures.json)
SECTION_STAGES = ("kv_tiers",)
CHECK_STAGES = ("kernels", "e2e", "figures")  # check.py --section STAGE
ENGINE_SECTIONS = {
    "end_to_end": "agreement",
    "profiling": "profiling",
    "throughput": "throughput",
    "adapters": "adapters",
}


def problems(report: dict) -> list[str]:
    """What in a check.py report failed: a section that raised, kernels off their twins, a backend that failed or
    whose tokens differ from the first backend's."""
    found = [f"{key} raised {error['error']}" for key, error in report.get("errors", {}).items()]
    cases = report.get("correctness", [])
    if off := [case for case in cases if not case["ok"]]:
        found.append(f"{len(off)} of {len(cases)} kernel cases failed")
    for key, label in ENGINE_SECTIONS.items():
        for row in report.get(key, []):
            if "error" in row:
                found.append(f"{label}: {row.get('backend', 'engine')} failed")
    # Rounding can flip a near-tie between two tokens, and greedy decoding then goes its own way from there, so a
    # backend is judged by where its sequences part from the first backend's: only at near ties (e2e.py's
    # NEAR_TIE_NATS). A wrong kernel parts at the first confident token. e2e.py marks the rows it judges: float32,
    # unquantized. fp8's own check is its layer's error in the kernels stage.
    for row in report.get("end_to_end", []):
        if not row.get("judged"):
            continue
        wide = row["sequences_parted"] - row["parted_at_near_ties"]
        if wide:
            found.append(
                f"{row['backend']} at {row['concurrency']}: {wide} of {row['concurrency']} sequences parted "
                f"from the first backend's past a near tie (widest {row['widest_parting_nats']} nats)"
            )
    return found + kv_tiers_problems(report.get("kv_tiers", {}))


def kv_tiers_problems(section: dict) -> list[str]:
    """A revisit that did not load its whole prefix from the host tier, loaded other bytes than were computed, or
    parted from the first visit's greedy tokens where that is judged (float32)."""
    found = []
    revisit = section.get("revisit", {})
    for i, trial in enumerate(revisit.get("trials", []), 1):
        expected = revisit["expected_cached_tokens"]
        if trial["revisit_cached_tokens_host"] < expected:
            found.append(
                f"kv_tiers trial {i}: the revisit loaded {trial['revisit_cached_tokens_host']} of {expected} "
                f"prefix tokens from the host tier ({trial['revisit_cached_tokens']} cached in all)"
            )
        if trial["blocks_compared"] == 0 or trial["blocks_identical"] < trial["blocks_compared"]:
            found.append(
                f"kv_tiers trial {i}: {trial['blocks_identical']} of {trial['blocks_compared']} loaded blocks "
                "hold the bytes first computed"
            )
        if not trial["tokens_ok"]:
            found.append(
                f"kv_tiers trial {i}: the revisit's greedy tokens {trial['tokens']} from the first's"
            )
    return found


def notes(report: dict) -> list[str]:
    """What a check.py report skipped, and the KV blocks the profiled engine sized."""
    found = []
    for key, label in ENGINE_SECTIONS.items():
        reasons = Counter(row["skipped"] for row in report.get(key, []) if "skipped" in row)
        found += [f"{label}: {reason}" + (f" x{n}" if n > 1 else "") for reason, n in reasons.items()]
    found += [
        f"profiling sized {row['kv_blocks']} KV blocks" + quantized_label(row)
        for row in report.get("profiling", [])
        if "kv_blocks" in row
    ]
    section = report.get("kv_tiers", {})
    skips = (section.get("skipped"), section.get("revisit", {}).get("skipped_trials"))
    return found + [f"kv_tiers: {skip}" for skip in skips if skip]


def test_counts(junit_xml: Path) -> dict[str, int]:
    """tests, failures, errors and skipped, summed over the JUnit file's suites."""
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}


def failed_tests(junit_xml: Path) -> list[str]:
    root = ET.parse(junit_xml).getroot()
    return [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]


def tests_note(counts: dict[str, int]) -> str:
    if counts["failures"] or counts["errors"]:
        failed = [f"{counts['failures']} failed"] if counts["failures"] else []
        return ", ".join(failed + ([f"{counts['errors']} errors"] if counts["errors"] else []))
    if counts["tests"] == 0:
        return "collected, none run"
    passed = counts["tests"] - counts["skipped"]
    return f"{passed} passed, {counts['skipped']} skipped"


def stage_note(stage: str, out_dir: Path) -> str:
    """The words after a stage's verdict in the summary line: its failures first, else its skips and findings."""
    if stage not in STAGE_FILES:
        return ""
    path = out_dir / STAGE_FILES[stage]
    if not path.is_file():
        return f"no {path.name}"
    try:
        if stage == "tests":
            return tests_note(test_counts(path))
        report = json.loads(path.read_text())
    except (OSError, ValueError, ET.ParseError) as error:
        return f"{path.name} unreadable: {error}"
    if stage in SECTION_STAGES:
        errors = {key: value for key, value in report.get("errors", {}).items() if key == stage}
        if stage not in report and not errors:
            return f"no {stage} in {path.name}"
        report = {stage: report.get(stage, {}), "errors": errors}
    if stage == "env":
        failures = report.get("import_failures", {})
        return f"{len(failures)} imports failed: {', '.join(failures)}" if failures else ""
    return "; ".join(problems(report) or notes(report))


def render_session(out_dir: Path) -> str:
    """Every stage's results that exist in out_dir, and the names of those that do not (or do not parse)."""
    blocks: list[list[str]] = []
    if (out_dir / "summary.txt").is_file():
        blocks.append([f"`{(out_dir / 'summary.txt').read_text().strip()}`"])
    found: dict[str, dict] = {}
    missing = []
    for stage, name in STAGE_FILES.items():
        if stage in SECTION_STAGES:  # read with its file's own stage
            continue
        try:
            found[stage] = (
                test_counts(out_dir / name) if stage == "tests" else json.loads((out_dir / name).read_text())
            )
        except (OSError, ValueError, ET.ParseError):
            missing.append(f"{stage} ({name})")
    if env := found.get("env"):
        versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items())
        lines = [f"{env['nvidia_smi']}; {versions}."]
        lines += [f"- does not import: {module}" for module in env["import_failures"]]
        blocks.append(lines)
    merged: dict = {"errors": {}}
    for stage in CHECK_STAGES:
        report = found.get(stage, {})
        merged |= {key: value for key, value in report.items() if key != "errors"}
        merged["errors"] |= report.get("errors", {})
    if any(stage in found for stage in CHECK_STAGES):
        blocks.append([render(merged).rstrip("\n")])
    if counts := found.get("tests"):
        lines = [f"Test files with CUDA cases: {tests_note(counts)} ({counts['tests']} in all)."]
        lines += [f"- failed: {name}" for name in failed_tests(out_dir / "tests.xml")]
        blocks.append(lines)
    if missing:
        blocks.append([f"Missing from this session: {', '.join(missing)}."])
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="check.py's --out file, or session.sh's $OUT")
    parser.add_argument("--note", metavar="STAGE", default=None, help="print the summary's note on STAGE")
    args = parser.parse_args(argv)
    if args.note is not None:
        print(stage_note(args.note, args.report))
        return 0
    try:
        if args.report.is_dir():
            sys.stdout.write(render_session(args.report))
        else:
            sys.stdout.write(render(json.loads(args.report.read_text())))
    except (OSError, ValueError, KeyError, ET.ParseError) as error:
        print(f"error: {args.report}: {error!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
