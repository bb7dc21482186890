"""The engine's seams, read from the source's ast (as tests/test_imports.py reads the import arrows).

Outside executor/ (gateway, shared, kernels, kvserve, bench), code imports only the executor's entry points:
- `executor`, the package root: LLM, SamplingParams, resolve_model, default_gguf, weight_bytes,
  ATTENTION_BACKENDS (all bench may use);
- `executor.llm`, the offline API;
- `executor.cli`, the executor's commands (kvserve's CLI and `kvserve up` add them);
- `executor.engine_config` and `executor.engine_args`, the engine's flags and their command-line form, torch-free
  (`kvserve up` writes executors' command lines with them).
Every other module of executor/ (engine, scheduler, KV cache manager, block pool, runner, sampler...) is the
engine's inside, free to change without a caller outside noticing.

Inside executor/, the engine's callers (service/, cli.py, llm.py) use only Engine's public surface,
ENGINE_SURFACE: what they need (requests in and out, a step, the statistics snapshot, the cache's hashes for the
executor index, the model's facts), never its parts (scheduler, kv, pool, runner, intake, grammar queue...).
"""

from __future__ import annotations

import ast

from tests.test_imports import REPO, all_imports

ENTRY_POINTS = {"executor", "executor.llm", "executor.cli", "executor.engine_config", "executor.engine_args"}
CALLERS = (
    "executor/service/loop.py",
    "executor/service/owned_requests.py",
    "executor/cli.py",
    "executor/llm.py",
)
ENGINE_SURFACE = {
    # requests and the step
    "add_request",
    "abort",
    "step",
    "has_unfinished",
    "is_unfinished",
    "is_compiling",
    "queue_full_for",
    "hand_back_overdue",
    "compile_grammar",
    "close",
    # what it publishes
    "stats",
    "cached_block_hashes",
    "tier_hashes",
    "drain_tier_events",
    "poll_tiers",
    # the model and settings it serves with
    "config",
    "tokenizer",
    "model_path",
    "block_size",
    "max_model_len",
    "waiting_tenants_share",
    # the KV tiers: the block source and fingerprint `--kv-transfer-port` serves, the puller built with the stack's
    # keys; None without a prefix cache
    "kv_tiers",
    # LoRA adapters: whether it serves them, the run-time registry, what its registration says, an offline load
    "serves_adapters",
    "sync_adapters",
    "adapter_registration",
    "load_adapter",
}


def engine_attributes(source: str) -> list[tuple[str, int]]:
    """Each `engine.X` and `<anything>.engine.X` the source reads: (X, line)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
            isinstance(owner, ast.Attribute) and owner.attr == "engine"
        ):
            found.append((node.attr, node.lineno))
    return sorted(found, key=lambda f: f[1])


def public_names(source: str, class_name: str) -> set[str]:
    """A class's public methods and properties, and the public attributes its __init__ sets on self."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef):
            names.add(item.name)
            if item.name == "__init__":
                for node in ast.walk(item):
                    on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    if on_self and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                        names.add(node.attr)
    return {name for name in names if not name.startswith("_")}


def test_nothing_outside_the_executor_imports_its_inside():
    wrong = [
        f"{found.where}: {found.source} imports {found.target}"
        for found in all_imports()
        if found.source.split(".")[0] != "executor"
        and found.target.split(".")[0] == "executor"
        and found.target not in ENTRY_POINTS
    ]
    assert not wrong, "engine internals imported outside executor/:\n" + "\n".join(wrong)


def test_service_cli_and_llm_use_only_the_engines_public_surface():
    wrong = [
        f"{path}:{line}: engine.{name}"
        for path in CALLERS
        for name, line in engine_attributes((REPO / path).read_text())
        if name not in ENGINE_SURFACE
    ]
    assert not wrong, "the engine's inside reached from its callers:\n" + "\n".join(wrong)


def test_the_engine_defines_its_public_surface():
    defined = public_names((REPO / "executor/engine.py").read_text(), "Engine")
    assert defined >= ENGINE_SURFACE, f"not defined on Engine: {sorted(ENGINE_SURFACE - defined)}"


def test_the_walks_see_what_they_should():
    """The checks above pass only if the walks find what they should: a reach inside is one."""
    source = (
        "class Engine:\n"
        "    def __init__(self):\n        self.pool, self._hidden = 1, 2\n        self.config = 3\n"
        "    def step(self): pass\n    def _forget(self): pass\n"
        "def serve(engine, service):\n    engine.pool.drain_events()\n    service.engine.groups\n    engine.step()\n"
    )
    assert engine_attributes(source) == [("pool", 8), ("groups", 9), ("step", 10)]
    assert public_names(source, "Engine") == {"pool", "config", "step"}
