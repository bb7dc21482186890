"""The `kvserve` command: one subcommand per job, each added to the parser by its own function."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from bench.load import add_bench_command
from executor.config import add_engine_args, config_from_args
from executor.model_files import DEFAULT_MODEL, ModelLoadError, resolve_model
from executor.service import add_executor_command
from gateway.cli import add_gateway_commands
from gateway.keys_cli import add_keys_commands

Handler = Callable[[argparse.Namespace], int]


def add_model_commands(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="manage local model files")
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull = actions.add_parser("pull", help="make a model ready locally and print its directory")
    pull.add_argument(
        "name",
        nargs="?",
        default=None,
        help=f"{DEFAULT_MODEL} (the default), a .gguf file or a model directory",
    )
    pull.set_defaults(handler=model_pull)


def model_pull(args: argparse.Namespace) -> int:
    try:
        print(resolve_model(args.name))
    except ModelLoadError as error:
        print(f"kvserve model pull: error: {error}", file=sys.stderr)
        return 1
    return 0


def add_generate_command(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate", help="run the engine offline on one prompt and print the answer"
    )
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(generate)
    generate.set_defaults(handler=generate_once)


def generate_once(args: argparse.Namespace) -> int:
    from executor.llm import LLM
    from executor.sampling_params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        llm = LLM(**vars(config))
        prompt = args.prompt
        if args.chat:
            messages = [{"role": "user", "content": prompt}]
            prompt = llm.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        (out,) = llm.generate([prompt], params)
    except ValueError as error:
        print(f"kvserve generate: error: {error}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0


# Each function adds one top-level subcommand and sets `handler` on its parsers; a new command is one more entry.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_model_commands,
    add_generate_command,
    add_executor_command,
    add_gateway_commands,
    add_keys_commands,
    add_bench_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving with a paged KV cache")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in SUBCOMMANDS:
        add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
