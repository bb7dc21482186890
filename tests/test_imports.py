"""Imports run one way (docs/architecture.md; FORBIDDEN below) and no module imports itself back: read from the
source's ast, module-level and function-level imports alike, so a violation is named by file and line before
anything runs."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("executor", "gateway", "kvkernels", "shared", "bench", "kvserve")

# package -> the packages it must never import; bench's narrower rule (the `executor` root only) is its own check
FORBIDDEN = {
    "shared": {"gateway", "executor", "kvkernels", "bench", "kvserve"},
    "gateway": {"executor", "kvkernels", "bench", "kvserve"},
    "executor": {"gateway", "bench", "kvserve"},
    "kvkernels": {"executor", "gateway", "bench", "kvserve"},
    # bench is a driver, as the tests are: it starts Redis (kvserve.redis_server) and writes CURVE keys
    # (kvserve.curve_keys_cli) as `kvserve up` does, so it may use kvserve/, never the gateway's insides
    "bench": {"gateway"},
}


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module, e.g. "gateway.cli"
    target: str  # the module it names, e.g. "executor.config"
    where: str  # "gateway/cli.py:13"
    type_checking: bool  # under `if TYPE_CHECKING:`: an arrow in the design, but never run


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, type_checking: bool = False):
    """Every import statement in the tree, wherever it sits, with whether it is under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, type_checking
        inner = type_checking or (isinstance(child, ast.If) and _is_type_checking(child))
        if isinstance(child, ast.If) and _is_type_checking(child):
            # the else branch of `if TYPE_CHECKING:` does run
            for node in child.body:
                yield from _nodes(ast.Module(body=[node], type_ignores=[]), True)
            for node in child.orelse:
                yield from _nodes(ast.Module(body=[node], type_ignores=[]), type_checking)
            continue
        yield from _nodes(child, inner)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Our own modules that `module` imports: `from a import b` names a.b when b is a module, else a."""
    is_package = path.name == "__init__.py"
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node, type_checking in _nodes(tree):
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for name in names:
            # `import a.b.c` names the deepest of our modules it reaches
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and (found_import := Import(module, ".".join(parts), where, type_checking)) not in found:
                found.append(found_import)
    return found


def all_imports() -> list[Import]:
    modules = module_files()
    return [found for module, path in modules.items() for found in imports_of(module, path, modules)]


def wrong_way(imports: list[Import]) -> list[str]:
    problems = []
    for found in imports:
        source, target = found.source.split(".")[0], found.target.split(".")[0]
        if target in FORBIDDEN.get(source, ()):
            problems.append(f"{found.where}: {found.source} imports {found.target} ({source} -> {target})")
        elif source == "bench" and target == "executor" and found.target != "executor":
            problems.append(
                f"{found.where}: {found.source} imports {found.target} (bench uses only the `executor` root)"
            )
    return problems


def cycles(imports: list[Import]) -> list[str]:
    """Each strongly connected group of modules (Tarjan), as one cycle through it with every arrow's line."""
    graph: dict[str, dict[str, str]] = {}
    for found in imports:
        if not found.type_checking and found.source != found.target:
            graph.setdefault(found.source, {}).setdefault(found.target, found.where)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(sorted(group), graph) for group in groups]


def _one_cycle(group: list[str], graph: dict[str, dict[str, str]]) -> str:
    """A path from the group's first module back to itself, inside the group (breadth first: the shortest)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, {})):
                if target not in members or target in came_from:
                    continue
                came_from[target] = node
                following.append(target)
        if start in came_from:
            break
        frontier = following
    path = [start]
    while True:
        previous = came_from[path[-1]]
        path.append(previous)
        if previous == start:
            break
    path.reverse()
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(path, path[1:], strict=False)) + f" -> {start}"


def test_imports_run_one_way():
    problems = wrong_way(all_imports())
    assert not problems, "imports the wrong way:\n" + "\n".join(problems)


def test_no_module_imports_itself_back():
    found = cycles(all_imports())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checks above pass only if the walk finds what it should: a wrong arrow hidden in a function is one."""
    modules = {
        "gateway.x": tmp_path / "x.py",
        "executor.y": tmp_path / "y.py",
        "gateway.z": tmp_path / "z.py",
    }
    modules["gateway.x"].write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import z\n"
        "if TYPE_CHECKING:\n    import executor.y\n"
        "def f():\n    from executor import y\n"
    )
    found = imports_of("gateway.x", modules["gateway.x"], modules)
    assert [(i.target, i.where.rsplit(":", 1)[1], i.type_checking) for i in found] == [
        ("gateway.z", "2", False),
        ("executor.y", "4", True),
        ("executor.y", "6", False),
    ]
    edges = [Import("gateway.x", "gateway.z", "x:1", False), Import("gateway.z", "gateway.x", "z:7", False)]
    assert cycles(edges) == ["gateway.x (x:1) -> gateway.z (z:7) -> gateway.x"]


# shared/ modules one side alone uses, each with why it stays
SHARED_ONE_SIDE: dict[str, str] = {}


def users_of_shared(imports: list[Import]) -> dict[str, set[str]]:
    """shared module -> the top-level packages that use it, directly or through other shared modules."""
    users = {module: set() for module in module_files() if module.startswith("shared.")}
    for found in imports:
        if found.target in users and not found.source.startswith("shared."):
            users[found.target].add(found.source.split(".")[0])
    through_shared = [f for f in imports if f.source in users and f.target in users]
    changed = True
    while changed:
        changed = False
        for found in through_shared:
            before = len(users[found.target])
            users[found.target] |= users[found.source]
            changed |= len(users[found.target]) != before
    return users


def test_every_shared_module_serves_both_sides():
    """shared/ holds what the gateway and the executor both use; a module one side alone needs lives in its package."""
    lonely = [
        f"shared/{module.split('.', 1)[1]}.py is used by {', '.join(sorted(used)) or 'nobody'}"
        for module, used in users_of_shared(all_imports()).items()
        if not {"gateway", "executor"} <= used and module not in SHARED_ONE_SIDE
    ]
    assert not lonely, "not shared by gateway/ and executor/:\n" + "\n".join(lonely)


def libraries_of(package: str) -> dict[str, str]:
    """Third-party top-level modules a package imports -> one place that does."""
    ours = {*PACKAGES, "tests"}
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        for node, _ in _nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or not node.module):
                continue
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in ours and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_shared_imports_no_library_only_one_side_uses():
    """A library only the gateway (starlette, jinja2) or only the executor (torch, xgrammar) imports would be
    loaded by the other side through shared/."""
    gateway, executor = set(libraries_of("gateway")), set(libraries_of("executor"))
    # msgpack is the wire protocol's (shared/protocol.py), which both sides speak; the executor also packs its own
    # KV block files and peer transfers with it, and that does not make the gateway's use of it less
    one_side = (gateway ^ executor) - {"msgpack"}
    wrong = [
        f"{where}: shared imports {name}"
        for name, where in libraries_of("shared").items()
        if name in one_side
    ]
    assert not wrong, "shared/ imports what one side alone uses:\n" + "\n".join(wrong)


def test_no_package_of_ours_shadows_an_installed_distributions_module():
    """Our packages sit at the top level, first on sys.path: one named as another distribution's module hides it.
    transformers 5.25 began to depend on Hugging Face's `kernels`, which our kernels package (now kvkernels) hid,
    and every model load failed at `from kernels import CUDAProperties`."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    shadowed = {p: others for p in PACKAGES if (others := set(providers.get(p, ())) - {"kvserve"})}
    assert not shadowed, f"these packages of ours hide modules of installed distributions: {shadowed}"
