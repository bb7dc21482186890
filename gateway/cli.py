"""`kvserve gateway`: one HTTP gateway, its arguments and start-up (`kvserve up`, kvserve/up.py, takes the same
HTTP arguments and runs it beside its executors). The gateway's draining server is gateway/server/draining.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.openai.request_limits import add_request_limit_args, request_limits
from gateway.openai.tools import TOOL_CALL_PARSERS
from gateway.response_store import add_response_store_args, store_limits
from gateway.routing.cost import ROUTING_POLICIES
from shared import logs
from shared.command_line import is_loopback, open_listener_refusal
from shared.curve_keys import GATEWAY, CurveKeyError, add_curve_keys_arg, load_gateway_keys
from shared.defaults import DEFAULT_MODEL, SHUTDOWN_GRACE_PERIOD_S

if TYPE_CHECKING:
    from gateway.server.draining import GatewayServer


def add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--redis-url", default=os.environ.get("KVSERVE_REDIS_URL"), help="default: $KVSERVE_REDIS_URL"
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients ask for")
    parser.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=ROUTING_POLICIES,
        help="cache_aware: least prefill still to compute plus load (gateway/routing/cost.py); others for comparison",
    )
    parser.add_argument(
        "--queue-timeout",
        type=_seconds,
        default=60.0,
        help="seconds a request may wait at the gateway while every executor's queue is full, then 503 "
        "with Retry-After (default: %(default)s)",
    )
    parser.add_argument(
        "--require-api-key",
        action="store_true",
        help="refuse to start without API keys in Redis (`kvserve keys create`), never serve without one",
    )
    parser.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without API keys while none exists on a non-loopback --host (without it such a gateway "
        "refuses to start until a key exists; a loopback one runs open anyway). Once any key has existed, "
        "requests need a valid one, even after the last is revoked",
    )
    parser.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,  # gateway.openai.body.BODY_TIMEOUT_S, which --help does not import
        help="seconds a client may take to send its request body, counted once its key is checked, then 408 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port only, for Prometheus (default: on --port while the gateway is open, "
        "not once API keys exist: metrics name every tenant)",
    )
    parser.add_argument(
        "--metrics-host", default=None, help="the metrics listener's address (default: --host)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template that replaces the model's (default: the model's own; requests with tools "
        "to a ChatML model whose template has none use gateway/prompt/tool_chat_template_hermes.jinja)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=(*TOOL_CALL_PARSERS, "none"),
        default=None,
        help='how tool_choice "auto" reads the calls the model writes (hermes: <tool_call>{...}</tool_call>). '
        "Default: the one the chat template implies (its tool-call tags; hermes for a ChatML template without "
        'tools, such as the default model\'s); none: tool_choice "auto" is refused. "required" and named '
        "functions need no parser",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING), to operator keys only (`kvserve keys create|update --operator`)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=None,
        help="json: one object per line with request and trace ids; text: for a person; auto (default, or "
        "$KVSERVE_LOG_FORMAT): text when stderr is a terminal, else json",
    )
    parser.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=SHUTDOWN_GRACE_PERIOD_S,
        help="seconds SIGTERM (or Ctrl-C) lets requests in flight finish while new ones get 503 "
        "(default: %(default)s; `up` passes it on to its executors)",
    )
    add_curve_keys_arg(parser, GATEWAY)
    add_request_limit_args(parser)
    add_response_store_args(parser)


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_gateway_args(gateway: argparse.ArgumentParser) -> None:
    add_http_args(gateway)
    gateway.add_argument("--model", default=None, help="model directory or name, for its tokenizer")
    gateway.set_defaults(handler=run_gateway)


def _served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return (
        DEFAULT_MODEL
        if args.model in (None, DEFAULT_MODEL)
        else os.path.basename(str(args.model).rstrip("/"))
    )


def run_gateway(args: argparse.Namespace, on_start: Callable[[GatewayServer], None] | None = None) -> int:
    """Serve until drained; `on_start` (from `kvserve up`) ties the server to what it supervises meanwhile."""
    from gateway.app import GatewayConfig, build_app
    from gateway.prompt.chat_template import choose_tool_call_parser, read_chat_template
    from gateway.prompt.tokenizer import load_tokenizer
    from gateway.server.draining import GatewayServer
    from gateway.server.exit_deadline import EXIT_MARGIN_S, exit_within
    from shared import tracing
    from shared.model_paths import ModelLoadError

    logs.configure("kvserve-gateway", args.log_format)
    if not args.redis_url:
        print(
            "kvserve gateway: error: --redis-url: not given and KVSERVE_REDIS_URL is not set", file=sys.stderr
        )
        return 2
    try:  # local files first: a bad one is said without waiting on Redis
        curve = load_gateway_keys(args.curve_keys) if args.curve_keys else None
    except CurveKeyError as error:
        print(f"kvserve gateway: error: --curve-keys: {error}", file=sys.stderr)
        return 2
    if args.require_api_key and args.allow_anonymous:
        print(
            "kvserve gateway: error: --allow-anonymous and --require-api-key contradict each other: give one",
            file=sys.stderr,
        )
        return 2
    anonymous_allowed = not args.require_api_key and (args.allow_anonymous or is_loopback(args.host))
    if (
        problem := _check_redis(args.redis_url, args.require_api_key, anonymous_allowed, args.host)
    ) is not None:
        message, code = problem
        print(f"kvserve gateway: error: {message}", file=sys.stderr)
        return code
    try:
        tokenizer = load_tokenizer(args.model)
    except ModelLoadError as error:
        print(f"kvserve gateway: error: --model: {error}", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        try:
            tokenizer.chat_template = read_chat_template(args.chat_template)
        except ValueError as error:
            print(f"kvserve gateway: error: --chat-template: {error}", file=sys.stderr)
            return 2
    tool_call_parser, why = choose_tool_call_parser(args.tool_call_parser, tokenizer.chat_template)
    logging.getLogger("kvserve.gateway").info(
        'tool-call parser: %s (%s): tool_choice "auto" is %s',
        tool_call_parser or "none",
        why,
        "served" if tool_call_parser else "refused",
    )
    config = GatewayConfig(
        args.redis_url,
        _served_name(args),
        tokenizer,
        args.routing_policy,
        args.require_api_key,
        args.queue_timeout,
        anonymous_allowed=anonymous_allowed,
        body_timeout_s=args.body_timeout,
        metrics_host=args.metrics_host or args.host,
        metrics_port=args.metrics_port,
        tool_call_parser=tool_call_parser,
        curve=curve,
        limits=request_limits(args),
        response_store=store_limits(args),
        runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    if tracing.configure("kvserve-gateway"):
        logging.getLogger("kvserve.gateway").info("tracing on: spans go out over OTLP")
    server = GatewayServer(build_app(config), args.host, args.port, args.shutdown_grace_period)
    server.on_drain.append(lambda: exit_within(args.shutdown_grace_period + EXIT_MARGIN_S))
    if on_start is not None:
        on_start(server)
    try:
        server.run()
    finally:
        tracing.shutdown()
    return 0


def _check_redis(
    redis_url: str, require_api_key: bool, anonymous_allowed: bool, host: str
) -> tuple[str, int] | None:
    """A missing or wrong password stops the start (it will not fix itself); so does a deployment that never
    had a key, where this gateway may not run open. An unreachable Redis stops it (exit 1) when --require-api-key
    needs it to find a key, and on a non-loopback --host, which must not start before it knows whether it may
    serve without one; a loopback gateway serves 503 and /health says why until Redis is back. Returns the
    one-line error and exit code, or None."""
    import redis
    import redis.asyncio as aioredis

    from gateway.tenants.api_keys import deployment_keyed
    from gateway.tenants.tenancy import REQUIRE_API_KEY_REFUSAL
    from shared.redis_url import describe_error

    async def keyed() -> bool:
        client = aioredis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        try:
            return await deployment_keyed(client)
        finally:
            await client.aclose()

    try:
        has_keys = asyncio.run(keyed())
    except redis.AuthenticationError as error:
        return f"--redis-url: {describe_error(redis_url, error)}", 2
    except redis.RedisError as error:
        if require_api_key:
            return f"--redis-url: {describe_error(redis_url, error)}", 1
        if not is_loopback(host):  # it fails closed: it cannot tell whether it may serve without a key
            return (
                f"--redis-url: {describe_error(redis_url, error)}; a gateway on a non-loopback --host ({host}) "
                "starts only once Redis tells it whether API keys exist"
            ), 1
        logging.getLogger("kvserve.gateway").error("%s", describe_error(redis_url, error))
        return None
    if has_keys:
        return None
    if require_api_key:
        return REQUIRE_API_KEY_REFUSAL, 2
    if not anonymous_allowed:
        message = open_listener_refusal(
            f"--host {host}",
            host,
            "no API key exists in Redis",
            "would be served without a key or limits",
            "Create a key (`kvserve keys create --tenant NAME`)",
            "--allow-anonymous",
        )
        return message, 2
    if not is_loopback(host):
        logging.getLogger("kvserve.gateway").warning(
            "--allow-anonymous: serving WITHOUT API KEYS on %s, to anyone who can reach it", host
        )
    return None
