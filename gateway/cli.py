"""`kvserve gateway` (one HTTP gateway) and `kvserve up` (Redis, executors and a gateway on one machine): their
arguments. The gateway's draining server is gateway/draining.py; what `up` runs beside it, gateway/local_stack.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from executor.config import add_engine_args, config_from_args, engine_argv
from gateway.supervisor import FIRST_BACKOFF_S, RESTART_LIMIT, RESTART_WINDOW_S
from shared.defaults import DEFAULT_MODEL, SHUTDOWN_GRACE_PERIOD_S

if TYPE_CHECKING:
    from gateway.local_stack import LocalStack

# CPU executors run below the gateway's priority: the gateway's work per request is small but sits on every
# request's path, and behind busy OpenMP threads it waited for a core (bench/soak.sh: added latency p50
# 15 ms -> 4 ms with the gateway first)
EXECUTOR_NICENESS = 10

UP_DESCRIPTION = (
    "Redis (embedded unless --redis-url), executors and a gateway on this machine. A child that dies is "
    f"restarted after {FIRST_BACKOFF_S} s, the wait doubling with each death within {RESTART_WINDOW_S:.0f} s; "
    f"{RESTART_LIMIT} deaths of one child within {RESTART_WINDOW_S:.0f} s end kvserve up with exit code 1, "
    "naming it. SIGTERM or Ctrl-C drains: new requests get 503 while those in flight finish (at most "
    "--shutdown-grace-period), then everything stops; a second signal stops at once."
)


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--redis-url", default=os.environ.get("KVSERVE_REDIS_URL"), help="default: $KVSERVE_REDIS_URL"
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients ask for")
    parser.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random"],
        help="cache_aware: least prefill still to compute plus load (gateway/routing.py); others for comparison",
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


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_gateway_commands(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    _add_http_args(gateway)
    gateway.add_argument("--model", default=None, help="model directory or name, for its tokenizer")
    gateway.set_defaults(handler=run_gateway)

    up = commands.add_parser(
        "up",
        help="the whole stack on this machine: Redis, executors, gateway",
        description=UP_DESCRIPTION,
    )
    _add_http_args(up)
    up.add_argument("--executors", type=int, default=1, help="how many executor processes")
    up.add_argument(
        "--executor-niceness",
        type=int,
        default=EXECUTOR_NICENESS,
        help="CPU executors run this much below the gateway's priority (default: %(default)s; 0: same)",
    )
    add_engine_args(up)
    up.set_defaults(handler=run_up)


def _served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return (
        DEFAULT_MODEL
        if args.model in (None, DEFAULT_MODEL)
        else os.path.basename(str(args.model).rstrip("/"))
    )


def run_gateway(args: argparse.Namespace, stack: LocalStack | None = None) -> int:
    """Serve until drained; with `stack` (from `kvserve up`), supervise its children meanwhile."""
    from gateway.app import GatewayConfig, build_app
    from gateway.draining import GatewayServer
    from gateway.model_dir import ModelDirError
    from gateway.tokenizer import load_tokenizer
    from shared import logs, tracing

    logs.configure("kvserve-gateway", args.log_format)
    if not args.redis_url:
        print(
            "kvserve gateway: error: --redis-url: not given and KVSERVE_REDIS_URL is not set", file=sys.stderr
        )
        return 2
    if args.require_api_key and not _keys_exist(args.redis_url):
        print(
            "kvserve gateway: error: --require-api-key: no API key exists in Redis; "
            "create one with `kvserve keys create --tenant NAME`",
            file=sys.stderr,
        )
        return 2
    try:
        tokenizer = load_tokenizer(args.model)
    except ModelDirError as error:
        print(f"kvserve gateway: error: --model: {error}", file=sys.stderr)
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
    )
    if tracing.configure("kvserve-gateway"):
        logging.getLogger("kvserve.gateway").info("tracing on: spans go out over OTLP")
    server = GatewayServer(build_app(config), args.host, args.port, args.shutdown_grace_period)
    if stack is not None:
        # a child that keeps dying drains the gateway like a SIGTERM, and kvserve up then exits 1
        server.on_drain.append(stack.hold)
        stack.watch(on_failure=server.begin_drain)
    try:
        server.run()
    finally:
        tracing.shutdown()
    return 0


def _keys_exist(redis_url: str) -> bool:
    import redis

    from shared import redis_keys

    return bool(redis.Redis.from_url(redis_url).scard(redis_keys.API_KEYS))


def run_up(args: argparse.Namespace) -> int:
    """Start what is missing (Redis unless --redis-url), N executors as supervised child processes, then the
    gateway here; on exit stop exactly the processes it started."""
    from executor.model_files import resolve_model
    from gateway.local_stack import ExecutorPlan, LocalStack, StackError
    from shared import logs
    from shared.redis_server import RedisServerError

    logs.configure("kvserve-up", args.log_format)

    if args.executors < 1:
        print("kvserve up: error: --executors must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.executor_niceness <= 19:
        print("kvserve up: error: --executor-niceness must be 0-19", file=sys.stderr)
        return 2
    if args.shutdown_grace_period < 0:
        print("kvserve up: error: --shutdown-grace-period must be at least 0", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        model_dir = str(resolve_model(config.model))  # pull once here, not in every executor at once
    except ValueError as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 2
    config.model = model_dir
    flags = ["--log-format", args.log_format, "--shutdown-grace-period", str(args.shutdown_grace_period)]
    plan = ExecutorPlan(args.executors, [*flags, *engine_argv(config)], config.device, args.executor_niceness)
    stack = LocalStack(plan, args.redis_url)
    # until the gateway serves (and drains on these itself), a signal unwinds through the cleanup below
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    try:
        stack.start()
        args.redis_url = stack.redis_url
        args.model = model_dir
        if args.served_model_name is None and _is_default(model_dir):
            args.served_model_name = DEFAULT_MODEL
        code = run_gateway(args, stack)
    except (StackError, RedisServerError) as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # stopping the children is bounded; let it finish
        stack.stop()
    if stack.failure is not None:
        print(f"kvserve up: error: {stack.failure}", file=sys.stderr)
        return 1
    return code


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _is_default(model_dir: str) -> bool:
    return os.path.basename(model_dir.rstrip("/")) == DEFAULT_MODEL
