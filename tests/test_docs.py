"""The docs stand alone: docs/architecture.md's module table names every module there is and none that is gone,
its contracts name every `kvserve` subcommand and every name `executor` exports, every repository path README.md
and docs/ name exists, and no file points at the folder outside the repository. Plain file reads (the code's
source parsed, never imported), so it runs in a fraction of a second."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
TABLE_SECTION = "## Where things live"

PACKAGES = ("executor", "gateway", "kvkernels", "shared", "kvserve")
TOP_FOLDERS = (*PACKAGES, "bench", "tests", "deploy", "docs")
# what git ignores (.gitignore): build outputs and caches, not the repository's files
IGNORED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", ".cache", ".gpu"}
IGNORED_PATHS = ("bench/results",)
# the folder beside the checkout, which a reader of the repository does not have; built from parts so that
# this file does not hold it
OUTSIDE = "../" + "shared"

ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")
# a path from the repository's root: not part of a longer path or URL, and ending in a name
FOLDERS = "|".join(TOP_FOLDERS)
REPO_PATH = re.compile(rf"(?<![\w./$~-])((?:{FOLDERS})/[\w./*-]*\w)")


def section(heading: str) -> str:
    """docs/architecture.md from `heading` to the next heading of its level."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_paths() -> list[str]:
    """The first cell of every table row in the module section, in order."""
    return [m.group(1) for line in section(TABLE_SECTION).splitlines() if (m := ROW.match(line))]


def _literal(path: Path, name: str) -> ast.expr:
    """The value assigned to `name` at the top of a module, read from its source."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value
    raise AssertionError(f"{_rel(path)} assigns no {name}")


def modules() -> set[str]:
    """Every module the table must name: the packages' Python files, the C++ kernels' sources, and bench's
    runnable files (Python and shell); a package's __init__.py may be named, and need not be."""
    found = set()
    for package in PACKAGES:
        found |= {_rel(p) for p in (REPO / package).rglob("*.py") if p.name != "__init__.py"}
    csrc = REPO / "kvkernels" / "csrc"
    found |= {_rel(p) for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    bench = [p for p in (REPO / "bench").rglob("*") if p.suffix in (".py", ".sh") and p.name != "__init__.py"]
    found |= {_rel(p) for p in bench if not _ignored(p)}
    return {m for m in found if "__pycache__" not in m}


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _ignored(path: Path) -> bool:
    rel = _rel(path)
    return any(
        part in IGNORED_DIRS or part.endswith(".egg-info") for part in path.relative_to(REPO).parts
    ) or any(rel == p or rel.startswith(p + "/") for p in IGNORED_PATHS)


def repository_files() -> list[Path]:
    files = []
    stack = [REPO]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if _ignored(entry):
                continue
            if entry.is_dir() and not entry.is_symlink():
                stack.append(entry)
            elif entry.is_file():
                files.append(entry)
    return files


def test_the_module_table_names_every_module():
    named = set(table_paths())
    missing = sorted(modules() - named)
    assert not missing, f"docs/architecture.md ({TABLE_SECTION}) does not name: {', '.join(missing)}"


def test_the_module_table_names_only_what_exists():
    gone = [path for path in table_paths() if not (REPO / path).exists()]
    assert not gone, f"docs/architecture.md ({TABLE_SECTION}) names what does not exist: {', '.join(gone)}"


def test_the_module_table_names_each_module_once():
    twice = [path for path, count in Counter(table_paths()).items() if count > 1]
    assert not twice, f"docs/architecture.md ({TABLE_SECTION}) names more than once: {', '.join(twice)}"


def test_every_path_the_docs_name_exists():
    gone = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for match in REPO_PATH.finditer(line):
                path = match.group(1)
                if any(path == p or path.startswith(p + "/") for p in IGNORED_PATHS):
                    continue  # what a benchmark writes, not the repository's
                if not any(REPO.glob(path)):
                    gone.append(f"{_rel(doc)}:{number}: {path}")
    assert not gone, "paths named that do not exist:\n" + "\n".join(gone)


def test_nothing_points_outside_the_repository():
    found = []
    for path in repository_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary: no link in it
        found += [
            f"{_rel(path)}:{number}" for number, line in enumerate(text.splitlines(), 1) if OUTSIDE in line
        ]
    assert not found, f"the repository must stand alone, but these name {OUTSIDE}: {', '.join(found)}"


def test_every_kvserve_subcommand_is_described():
    commands = _literal(REPO / "kvserve" / "cli.py", "COMMANDS")
    names = [call.args[0].value for call in commands.elts]  # Command("name", module, add_args, help)
    text = section("## Commands")
    missing = [name for name in names if f"`kvserve {name}" not in text]
    assert not missing, f"docs/architecture.md (## Commands) does not describe: {', '.join(missing)}"


def test_every_name_the_offline_api_exports_is_described():
    exported = ast.literal_eval(_literal(REPO / "executor" / "__init__.py", "__all__"))
    text = section("## The offline API")
    missing = [name for name in exported if f"`{name}" not in text]
    assert not missing, f"docs/architecture.md (## The offline API) does not describe: {', '.join(missing)}"
