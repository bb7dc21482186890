"""`kvserve up`: Redis (embedded unless --redis-url), N executors as supervised child processes, and the gateway
in this process. It imports neither side's engine: the model is pulled by a `kvserve model pull` child, so this
process, the gateway's, never loads torch."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from executor.cli import add_zmq_sndhwm_arg
from executor.engine_args import add_engine_args, config_from_args, engine_argv
from executor.engine_config import EngineConfig
from gateway.cli import add_http_args, run_gateway
from gateway.server.exit_deadline import EXIT_MARGIN_S
from kvserve.curve_keys_cli import write_keys
from kvserve.data_dir import BOTH_GIVEN, DataDir, DataDirError, add_data_dir_arg, data_dir_path, open_data_dir
from kvserve.runtime_dir import RunDir, open_run_dir, runtime_root
from kvserve.supervisor import FIRST_BACKOFF_S, RESTART_LIMIT, RESTART_WINDOW_S
from shared.curve_keys import CurveKeyError, load_executor_keys, load_gateway_keys
from shared.defaults import DEFAULT_MODEL
from shared.model_paths import check_model_dir, pulled_model_dir

# CPU executors run below the gateway's priority: the gateway's work per request is small but sits on every
# request's path, and behind busy OpenMP threads it waits for a core (bench/serving/soak.sh: added latency p50 4 ms
# with the gateway first, 15 ms without)
EXECUTOR_NICENESS = 10

UP_DESCRIPTION = (
    "Redis (embedded unless --redis-url), executors and a gateway on this machine. The embedded Redis keeps "
    "its data (API keys, usage, stored responses) across runs in the data directory: --data-dir, else "
    "$KVSERVE_HOME, else $XDG_DATA_HOME/kvserve, else ~/.local/share/kvserve; one `kvserve up` at a time "
    "serves from it, and `kvserve keys` finds it there. What lives only for the run (its CURVE keys) is in a "
    "private folder of its own under $XDG_RUNTIME_DIR/kvserve, else the data directory's run/, removed when it "
    "ends, or by the next start after a kill -9. A child that dies is "
    f"restarted after {FIRST_BACKOFF_S} s, the wait doubling with each death within {RESTART_WINDOW_S:.0f} s; "
    f"{RESTART_LIMIT} deaths of one child within {RESTART_WINDOW_S:.0f} s end kvserve up with exit code 1, "
    "naming it. SIGTERM or Ctrl-C drains: new requests get 503 while those in flight finish (at most "
    "--shutdown-grace-period), then everything stops; a second signal stops at once. Whatever is stuck, it "
    f"ends at the latest {EXIT_MARGIN_S:g} s after the grace period, and its children die with it however it "
    "ends, kill -9 included."
)


def add_up_args(up: argparse.ArgumentParser) -> None:
    up.description = UP_DESCRIPTION
    add_http_args(up)
    up.add_argument("--executors", type=int, default=1, help="how many executor processes")
    add_data_dir_arg(up)
    up.add_argument(
        "--executor-niceness",
        type=int,
        default=EXECUTOR_NICENESS,
        help="CPU executors run this much below the gateway's priority (default: %(default)s; 0: same)",
    )
    add_zmq_sndhwm_arg(up)
    add_engine_args(up)
    up.set_defaults(handler=run_up)


def run_up(args: argparse.Namespace) -> int:
    """Start what is missing (Redis unless --redis-url), N executors as supervised child processes, then the
    gateway here; on exit stop exactly the processes it started, and remove this run's private folder."""
    from kvserve.store import StoreBusy, check_not_served
    from shared import logs

    try:  # resolved here, and handed down as such: the children write to this process's stderr
        args.log_format = logs.resolve(args.log_format)
    except ValueError as error:
        print(f"kvserve up: error: KVSERVE_LOG_FORMAT: {error}", file=sys.stderr)
        return 2
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
    if args.redis_url and args.data_dir:
        print(
            f"kvserve up: error: {BOTH_GIVEN}",
            file=sys.stderr,
        )
        return 2
    data = None
    if not args.redis_url:
        try:  # before the model's pull, which may take minutes
            data = open_data_dir(data_dir_path(args.data_dir))
            check_not_served(data)
        except (DataDirError, StoreBusy) as error:
            print(f"kvserve up: error: {error}", file=sys.stderr)
            return 1
    try:
        config = config_from_args(args)
        # pulled once here (by a child: this process must not load torch), not in every executor at once
        model_dir = str(pulled_model_dir(config.model))
        check_model_dir(Path(model_dir))
    except ValueError as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 2
    config.model = model_dir
    try:
        run = open_run_dir(runtime_root(args.data_dir))
    except DataDirError as error:
        print(f"kvserve up: error: {error}", file=sys.stderr)
        return 1
    try:
        return _run_stack(args, config, data, run)
    finally:
        run.remove()


def _run_stack(args: argparse.Namespace, config: EngineConfig, data: DataDir | None, run: RunDir) -> int:
    """The stack with this run's private folder (its CURVE keys, unless given): started, served, stopped."""
    from kvserve.local_stack import ExecutorPlan, LocalStack, StackError
    from kvserve.redis_server import RedisServerError
    from kvserve.store import StoreBusy

    try:
        args.curve_keys = _curve_keys(args.curve_keys, run.path)
    except CurveKeyError as error:
        print(f"kvserve up: error: --curve-keys: {error}", file=sys.stderr)
        return 2
    flags = ["--log-format", args.log_format, "--shutdown-grace-period", str(args.shutdown_grace_period)]
    flags += ["--curve-keys", args.curve_keys, "--zmq-sndhwm", str(args.zmq_sndhwm)]
    kv_offload_dir, config.kv_offload_dir = (
        config.kv_offload_dir,
        None,
    )  # a folder per executor (ExecutorPlan)
    plan = ExecutorPlan(
        args.executors,
        [*flags, *engine_argv(config)],
        config.device,
        args.executor_niceness,
        kv_offload_dir,
        kv_transfer=args.executors > 1,
    )
    stack = LocalStack(plan, args.redis_url, data)

    def supervise(server) -> None:
        # a child that keeps dying drains the gateway like a SIGTERM, and kvserve up then exits 1
        server.on_drain.append(stack.hold)
        stack.watch(on_failure=server.begin_drain)

    # until the gateway serves (and drains on these itself), a signal unwinds through the cleanup below
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    try:
        stack.start()
        args.redis_url = stack.redis_url
        args.model = config.model
        if args.served_model_name is None and _is_default(config.model):
            args.served_model_name = DEFAULT_MODEL
        code = run_gateway(args, supervise)
    except (StackError, RedisServerError, StoreBusy) as error:
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


def _curve_keys(given: str | None, run_dir: Path) -> str:
    """The directory of the CURVE keys the stack runs with: the given one, checked for both sides before
    anything starts, or a fresh pair for this run only, in its runtime folder."""
    if given is not None:
        load_executor_keys(given)
        load_gateway_keys(given)
        return given
    directory = run_dir / "curve"
    write_keys(directory)
    return str(directory)


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _is_default(model_dir: str) -> bool:
    return os.path.basename(model_dir.rstrip("/")) == DEFAULT_MODEL
