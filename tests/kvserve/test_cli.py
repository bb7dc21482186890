"""The `kvserve` dispatcher: help for every command without torch, and a one-line error where the executor's
libraries are not installed (the gateway image)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.cli import COMMANDS, EXECUTOR_EXTRA
from tests.processes import REPO

# Runs `kvserve ARGS...` in this interpreter, then prints the heavy modules it imported; with --without-extra,
# every module of the executor extra is absent first, as in an install of the base dependencies alone.
WRAPPER = """
import json, sys
extra = json.loads(sys.argv[1])
args = sys.argv[3:]
if sys.argv[2] == "--without-extra":
    for name in extra:
        sys.modules[name] = None  # `import torch` now raises ModuleNotFoundError, as when it is not installed
from kvserve.cli import main
try:
    code = main(args)
except SystemExit as exit_:
    code = exit_.code
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules if sys.modules[m] is not None} & set(extra))))
sys.exit(code)
"""


def kvserve(*args: str, without_extra: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    mode = "--without-extra" if without_extra else "--with-extra"
    argv = [sys.executable, "-c", WRAPPER, json.dumps(EXECUTOR_EXTRA), mode, *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def heavy_modules(done: subprocess.CompletedProcess) -> list[str]:
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args", [["--help"], ["gateway", "--help"], ["up", "--help"], ["executor", "--help"], ["model", "--help"]]
)
def test_help_imports_no_torch_and_no_transformers(args):
    done = kvserve(*args)
    assert done.returncode == 0, done.stderr
    assert "usage: kvserve" in done.stdout
    assert heavy_modules(done) == []


def test_help_lists_every_command():
    done = kvserve("--help")
    for command in COMMANDS:
        assert f"    {command.name}" in done.stdout, command.name


@pytest.mark.parametrize(
    "args", [["--help"], ["gateway", "--help"], ["up", "--help"], ["keys", "--help"], ["bench", "--help"]]
)
def test_the_gateway_side_needs_nothing_of_the_executor_extra(args):
    done = kvserve(*args, without_extra=True)
    assert done.returncode == 0, done.stderr


def test_engine_commands_without_the_extra_name_what_is_missing_in_one_line(redis_url, tmp_path):
    commands = [
        ["generate", "hi"],
        ["executor", "--executor-id", "e", "--bind", "tcp://127.0.0.1:1", "--redis-url", redis_url],
    ]
    for args in commands:
        done = kvserve(*args, without_extra=True)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"kvserve {args[0]}: error: needs torch, which is not installed here: "
            "install the executor extra (pip install 'kvserve[executor]')"
        ], done.stderr


def test_up_pulls_the_model_in_a_child_and_names_what_is_wrong_with_it(tmp_path):
    """`kvserve up` is the gateway's process: a model that cannot be pulled is reported from the pull's child,
    and the parent has not loaded the engine's libraries to find that out."""
    missing = tmp_path / "nowhere"
    done = kvserve("up", "--model", str(missing), "--log-format", "text")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvserve up: error: model {str(missing)!r}: expected 'SmolLM2-135M-Instruct', a .gguf file or a model directory"
    )
    assert heavy_modules(done) == []


def test_gateway_chat_template_flag_names_a_file_it_cannot_read(tmp_path, default_model):
    missing = tmp_path / "none.jinja"
    done = kvserve(
        "gateway",
        "--redis-url",
        "redis://127.0.0.1:1",
        "--model",
        default_model,
        "--chat-template",
        str(missing),
    )
    assert done.returncode == 2, done.stderr
    assert f"--chat-template: {missing} cannot be read" in done.stderr


def test_tool_call_parser_is_hermes_or_none():
    done = kvserve("gateway", "--tool-call-parser", "mistral")
    assert done.returncode == 2 and "--tool-call-parser: invalid choice: 'mistral'" in done.stderr
