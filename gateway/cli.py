"""`kvserve gateway`: one HTTP gateway, its arguments and start-up (`kvserve up`, kvserve/up.py, takes the same
HTTP arguments and runs it beside its executors). The gateway's draining server is gateway/draining.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.request_limits import add_request_limit_args, request_limits
from gateway.routing_cost import ROUTING_POLICIES
from gateway.tools import TOOL_CALL_PARSERS
from shared.curve_keys import GATEWAY, CurveKeyError, add_curve_keys_arg, gateway_keys
from shared.defaults import DEFAULT_MODEL, SHUTDOWN_GRACE_PERIOD_S

if TYPE_CHECKING:
    from gateway.draining import GatewayServer


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
        help="cache_aware: least prefill still to compute plus load (gateway/routing_cost.py); others for comparison",
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
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port only, for Prometheus (default: on --port, unless --require-api-key: "
        "metrics name every tenant)",
    )
    parser.add_argument(
        "--metrics-host", default=None, help="the metrics listener's address (default: --host)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template that replaces the model's (default: the model's own; requests with tools "
        "to a ChatML model whose template has none use gateway/tool_chat_template_hermes.jinja)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='how the model writes tool calls; tool_choice "auto" needs one (hermes: '
        '<tool_call>{...}</tool_call>, ChatML models; "required" and named functions need none)',
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=os.environ.get("KVSERVE_LOG_FORMAT", "json"),
        help="json: one object per line with request and trace ids (default; or $KVSERVE_LOG_FORMAT)",
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
    from gateway.chat_template import read_chat_template
    from gateway.draining import GatewayServer
    from gateway.tokenizer import load_tokenizer
    from shared import logs, tracing
    from shared.model_paths import ModelLoadError

    logs.configure("kvserve-gateway", args.log_format)
    if not args.redis_url:
        print(
            "kvserve gateway: error: --redis-url: not given and KVSERVE_REDIS_URL is not set", file=sys.stderr
        )
        return 2
    try:  # local files first: a bad one is said without waiting on Redis
        curve = gateway_keys(args.curve_keys) if args.curve_keys else None
    except CurveKeyError as error:
        print(f"kvserve gateway: error: --curve-keys: {error}", file=sys.stderr)
        return 2
    if (problem := _check_redis(args.redis_url, args.require_api_key)) is not None:
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
    config = GatewayConfig(
        args.redis_url,
        _served_name(args),
        tokenizer,
        args.routing_policy,
        args.require_api_key,
        args.queue_timeout,
        metrics_host=args.metrics_host or args.host,
        metrics_port=args.metrics_port,
        tool_call_parser=args.tool_call_parser,
        curve=curve,
        limits=request_limits(args),
    )
    if tracing.configure("kvserve-gateway"):
        logging.getLogger("kvserve.gateway").info("tracing on: spans go out over OTLP")
    server = GatewayServer(build_app(config), args.host, args.port, args.shutdown_grace_period)
    if on_start is not None:
        on_start(server)
    try:
        server.run()
    finally:
        tracing.shutdown()
    return 0


def _check_redis(redis_url: str, require_api_key: bool) -> tuple[str, int] | None:
    """A missing or wrong password stops the start (it will not fix itself); an unreachable Redis does only when
    --require-api-key needs it to find a key: otherwise the gateway serves 503 and /health says why until it is
    back. Returns the one-line error and exit code, or None."""
    import redis

    from shared import redis_keys
    from shared.redis_url import describe_error

    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        has_keys = bool(client.scard(redis_keys.API_KEYS))
    except redis.AuthenticationError as error:
        return f"--redis-url: {describe_error(redis_url, error)}", 2
    except redis.RedisError as error:
        if require_api_key:
            return f"--redis-url: {describe_error(redis_url, error)}", 1
        logging.getLogger("kvserve.gateway").error("%s", describe_error(redis_url, error))
        return None
    finally:
        client.close()
    if require_api_key and not has_keys:
        message = "--require-api-key: no API key exists in Redis; create one with `kvserve keys create --tenant NAME`"
        return message, 2
    return None
