"""`kvserve gateway` (one HTTP gateway) and `kvserve up` (Redis, executors and a gateway on one machine)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from executor.config import add_engine_args, config_from_args, engine_argv
from shared.defaults import DEFAULT_MODEL
from shared.redis_server import free_port

# CPU executors run below the gateway's priority: the gateway's work per request is small but sits on every
# request's path, and behind busy OpenMP threads it waited for a core (bench/soak.sh: added latency p50
# 15 ms -> 4 ms with the gateway first)
EXECUTOR_NICENESS = 10

log = logging.getLogger("kvserve.up")

EXECUTOR_START_TIMEOUT_S = 600  # the first start may pull and convert the default model


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

    up = commands.add_parser("up", help="the whole stack on this machine: Redis, executors, gateway")
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


def run_gateway(args: argparse.Namespace) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from executor.model_files import ModelLoadError, resolve_model
    from gateway.app import GatewayConfig, build_app
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
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model), local_files_only=True)
    except (ModelLoadError, OSError) as error:
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
    try:
        # log_config=None: uvicorn's own lines go through the same (JSON) handler as ours
        uvicorn.run(build_app(config), host=args.host, port=args.port, access_log=False, log_config=None)
    finally:
        tracing.shutdown()
    return 0


def _keys_exist(redis_url: str) -> bool:
    import redis

    from shared import redis_keys

    return bool(redis.Redis.from_url(redis_url).scard(redis_keys.API_KEYS))


def _wait_for_executors(redis_url: str, ids: list[str], children: list[subprocess.Popen]) -> None:
    import redis

    from shared import redis_keys

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + EXECUTOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(client.exists(redis_keys.executor_key(i)) for i in ids):
            return
        dead = [c for c in children if c.poll() is not None]
        if dead:
            raise RuntimeError(f"an executor exited with code {dead[0].returncode} while starting")
        time.sleep(0.2)
    raise RuntimeError(f"executors did not register within {EXECUTOR_START_TIMEOUT_S} s")


def run_up(args: argparse.Namespace) -> int:
    """Start what is missing (Redis unless --redis-url), N executors as child processes, then the gateway here;
    on exit stop exactly the processes it started."""
    from executor.model_files import resolve_model
    from shared import logs

    logs.configure("kvserve-up", args.log_format)

    if args.executors < 1:
        print("kvserve up: error: --executors must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.executor_niceness <= 19:
        print("kvserve up: error: --executor-niceness must be 0-19", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        model_dir = str(resolve_model(config.model))  # pull once here, not in every executor at once
    except ValueError as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 2
    config.model = model_dir
    # uvicorn re-raises SIGTERM after its own shutdown; as an exception it unwinds through the cleanup below
    signal.signal(signal.SIGTERM, _exit_on_signal)
    embedded = None
    children: list[subprocess.Popen] = []
    try:
        if not args.redis_url:
            from shared.redis_server import start_redis_server

            embedded = start_redis_server()
            args.redis_url = embedded.url
            log.info("embedded Redis at %s", embedded.url)
        ids = [f"executor-{i}" for i in range(args.executors)]
        for executor_id in ids:
            bind = f"tcp://127.0.0.1:{free_port()}"
            argv = [sys.executable, "-m", "executor.cli", "executor", "--executor-id", executor_id]
            argv += ["--bind", bind, "--redis-url", args.redis_url, "--log-format", args.log_format]
            argv += engine_argv(config)
            children.append(start_executor(argv, args.executors, config.device, args.executor_niceness))
        _wait_for_executors(args.redis_url, ids, children)
        args.model = model_dir
        if args.served_model_name is None and _is_default(model_dir):
            args.served_model_name = DEFAULT_MODEL
        return run_gateway(args)
    except RuntimeError as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 1
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=35)
            except subprocess.TimeoutExpired:
                child.kill()
        if embedded is not None:
            embedded.stop()


def start_executor(argv: list[str], num_executors: int, device: str, niceness: int) -> subprocess.Popen:
    """One executor child process. CPU executors split this machine's cores between them (oversubscribed
    OpenMP threads spin against each other: two executors with two threads each on two cores ran several
    times slower) unless OMP_NUM_THREADS is set, and run `niceness` below the gateway."""
    env = dict(os.environ)
    if device == "cuda":
        return subprocess.Popen(argv, env=env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // num_executors)))
    return subprocess.Popen(argv, env=env, preexec_fn=lambda: os.nice(niceness) if niceness else None)


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _is_default(model_dir: str) -> bool:
    return os.path.basename(model_dir.rstrip("/")) == DEFAULT_MODEL
