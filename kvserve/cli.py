"""The `kvserve` command: it knows each subcommand's name and module, and imports only the module of the one asked
for, so `kvserve --help` and `kvserve gateway --help` load neither torch nor the other side."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# what the `executor` extra adds to the base install (pyproject.toml; tests/test_deployment.py keeps them equal)
EXECUTOR_EXTRA = (
    "torch",
    "transformers",
    "safetensors",
    "gguf",
    "numpy",
    "sentencepiece",
    "ninja",
    "triton",
    "xgrammar",
)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    module: str
    add_args: str  # the module's function that fills the command's parser and sets its `handler`
    help: str


COMMANDS = (
    Command("model", "executor.cli", "add_model_args", "manage local model files"),
    Command(
        "generate",
        "executor.cli",
        "add_generate_args",
        "run the engine offline on one prompt and print the answer",
    ),
    Command(
        "executor", "executor.cli", "add_executor_args", "serve one engine over ZeroMQ, registered in Redis"
    ),
    Command("gateway", "gateway.cli", "add_gateway_args", "the OpenAI-compatible HTTP gateway"),
    Command("up", "kvserve.up", "add_up_args", "the whole stack on this machine: Redis, executors, gateway"),
    Command(
        "ready", "kvserve.ready", "add_ready_args", "exit 0 when an executor is registered in Redis (a probe)"
    ),
    Command(
        "keys",
        "kvserve.keys_cli",
        "add_keys_args",
        "tenants' API keys: create, list, revoke, usage, export, import",
    ),
    Command(
        "curve-keys",
        "kvserve.curve_keys_cli",
        "add_curve_keys_args",
        "write ZeroMQ CURVE key pairs with which executors let in only gateways",
    ),
    Command(
        "bench",
        "bench.load",
        "add_bench_args",
        "load-test an OpenAI-compatible server and report TTFT, ITL, TPOT and throughput",
    ),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command listed by name; only `command`'s module is imported, to give it its arguments."""
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving with a paged KV cache")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for each in COMMANDS:
        sub = commands.add_parser(each.name, help=each.help, description=each.help)
        if each.name == command:
            add_args: Callable[[argparse.ArgumentParser], None] = getattr(
                importlib.import_module(each.module), each.add_args
            )
            add_args(sub)
    return parser


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line message for a module only the `executor` extra installs, else None (a real bug: re-raise)."""
    name = (error.name or "").split(".")[0]
    if name not in EXECUTOR_EXTRA:
        return None
    return f"needs {name}, which is not installed here: install the executor extra (pip install 'kvserve[executor]')"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    try:
        args = build_parser(command).parse_args(argv)
        return args.handler(args)
    except ModuleNotFoundError as error:
        if (message := missing_extra(error)) is None:
            raise
        print(f"kvserve {command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
