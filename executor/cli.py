"""The executor's own commands: `kvserve executor` (one engine behind ZeroMQ), `kvserve generate` (one prompt,
offline) and `kvserve model pull`. `kvserve` (kvserve/cli.py) imports this module for them alone; it imports
only argparse and shared/ here, the engine and its torch inside the handlers, so `--help` answers at once."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from executor.engine_args import add_engine_args, config_from_args
from executor.service.gateway_outbox import DEFAULT_SNDHWM
from shared import logs
from shared.command_line import is_loopback, open_listener_refusal, positive_int, zmq_host
from shared.curve_keys import EXECUTOR, CurveKeyError, add_curve_keys_arg, load_executor_keys
from shared.defaults import DEFAULT_MODEL, SHUTDOWN_GRACE_PERIOD_S
from shared.model_paths import ModelLoadError

log = logging.getLogger("kvserve.executor")

MODEL_WAIT_POLL_S = 1.0


def add_model_args(model: argparse.ArgumentParser) -> None:
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull = actions.add_parser("pull", help="make a model ready locally and print its directory")
    pull.add_argument(
        "name",
        nargs="?",
        default=None,
        help=f"{DEFAULT_MODEL} (the default), a .gguf file or a model directory",
    )
    pull.set_defaults(handler=model_pull)
    wait = actions.add_parser(
        "wait",
        help="wait until another process (an executor pod's `kvserve model pull`) has pulled a model into "
        "the shared cache, then print its directory; needs no torch, so the gateway's image runs it too",
    )
    wait.add_argument("name", nargs="?", default=None, help="as for pull (default: the default model)")
    wait.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds to wait before failing (default: %(default)s)"
    )
    wait.set_defaults(handler=model_wait)


def model_pull(args: argparse.Namespace) -> int:
    from executor.models.model_files import resolve_model

    try:
        print(resolve_model(args.name))
    except ModelLoadError as error:
        print(f"kvserve model pull: error: {error}", file=sys.stderr)
        return 1
    return 0


def model_wait(args: argparse.Namespace) -> int:
    """Polls the cache: a pull renames the model's directory into place whole, so once it passes
    check_model_dir it is complete."""
    from shared.model_paths import check_model_dir, model_dir

    deadline = time.monotonic() + args.timeout
    while True:
        try:
            path = model_dir(args.name)
            check_model_dir(path)
        except ModelLoadError as error:
            if time.monotonic() >= deadline:
                print(
                    f"kvserve model wait: error: not ready after {args.timeout:g} s: {error}", file=sys.stderr
                )
                return 1
            time.sleep(MODEL_WAIT_POLL_S)
            continue
        print(path)
        return 0


def add_generate_args(generate: argparse.ArgumentParser) -> None:
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(generate)
    generate.set_defaults(handler=generate_once)


def generate_once(args: argparse.Namespace) -> int:
    from executor.llm import LLM
    from shared.sampling_params import SamplingParams

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


def add_zmq_sndhwm_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--zmq-sndhwm",
        type=positive_int,
        default=DEFAULT_SNDHWM,
        metavar="N",
        help="step messages queued to one gateway in ZeroMQ (its ZMQ_SNDHWM), and as many more held by the "
        "executor, before a gateway that falls behind reading them has its requests ended with an error "
        f"rather than lose tokens (default: {DEFAULT_SNDHWM}, ZeroMQ's own)",
    )


def add_executor_args(executor: argparse.ArgumentParser) -> None:
    executor.add_argument("--executor-id", required=True, help="unique name; its Redis keys carry it")
    executor.add_argument(
        "--bind", required=True, help="ZeroMQ address to listen on, e.g. tcp://127.0.0.1:5600"
    )
    executor.add_argument(
        "--advertise-address", default=None, help="address gateways connect to (default: --bind)"
    )
    executor.add_argument(
        "--redis-url",
        default=os.environ.get("KVSERVE_REDIS_URL"),
        help="Redis URL (default: the KVSERVE_REDIS_URL environment variable)",
    )
    executor.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=SHUTDOWN_GRACE_PERIOD_S,
        help="seconds SIGTERM waits for running requests before aborting them",
    )
    add_zmq_sndhwm_arg(executor)
    executor.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=None,
        help="log lines as JSON objects or plain text (default: KVSERVE_LOG_FORMAT, else auto: text on a terminal)",
    )
    add_curve_keys_arg(executor, EXECUTOR)
    executor.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="serve without --curve-keys on a --bind (or --kv-transfer-host) other machines can reach: without "
        "it such an executor refuses to start, since whoever reaches its port runs requests past the gateway's "
        "API keys, limits and cache salts (loopback and ipc:// need no keys)",
    )
    add_kv_transfer_args(executor)
    add_engine_args(executor)
    executor.set_defaults(handler=serve)


def add_kv_transfer_args(executor: argparse.ArgumentParser) -> None:
    executor.add_argument(
        "--kv-transfer-port",
        type=_port_number,
        default=0,
        metavar="PORT",
        help="serve this executor's cached KV blocks (pool and tiers) to other executors on PORT, so a request "
        "routed to one of them pulls its prefix from here rather than compute it; with --curve-keys only holders "
        "of the executor key pull (default: 0, off; pulling from peers needs no port)",
    )
    executor.add_argument(
        "--kv-transfer-host",
        default=None,
        metavar="HOST",
        help="interface for --kv-transfer-port (default: the host of --bind, so blocks are as reachable as "
        "requests; 127.0.0.1 when --bind is not tcp://); published to other executors as the host of "
        "--advertise-address (else --bind), or as HOST itself when it names one interface",
    )


def serve(args: argparse.Namespace) -> int:
    """Start-up, then the service loop (executor/service/loop.py) until drained."""
    import redis
    import zmq

    from executor.service.index_writer import IndexWriter, connect
    from shared import tracing
    from shared.redis_keys import check_executor_id
    from shared.redis_url import describe_error

    def fail(message: str, code: int = 2) -> int:
        print(f"kvserve executor: error: {message}", file=sys.stderr)
        return code

    try:
        logs.configure("kvserve-executor", args.log_format)
    except ValueError as error:
        return fail(f"KVSERVE_LOG_FORMAT: {error}")
    if not args.redis_url:
        return fail("--redis-url: not given and KVSERVE_REDIS_URL is not set")
    try:
        executor_id = check_executor_id(args.executor_id)
        config = config_from_args(args)
        curve = load_executor_keys(args.curve_keys) if args.curve_keys else None
        if curve is None and not args.allow_insecure_bind and (refusal := _open_listener(args)) is not None:
            return fail(refusal)
        client = connect(args.redis_url)
        client.ping()
    except CurveKeyError as error:
        return fail(f"--curve-keys: {error}")
    except ValueError as error:
        return fail(str(error))
    except redis.RedisError as error:
        return fail(f"--redis-url: {describe_error(args.redis_url, error)}", 1)

    from executor.engine import Engine
    from executor.service.gateway_auth import GatewayAuth
    from executor.service.gateway_outbox import configure_router
    from executor.service.loop import ExecutorService

    # SIGTERM during the model load has nothing to drain: it just ends the process
    engine = Engine(config)
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    configure_router(socket, args.zmq_sndhwm)
    auth = GatewayAuth(context, socket, curve) if curve is not None else None
    try:
        socket.bind(args.bind)
    except zmq.ZMQError as error:
        if auth is not None:
            auth.stop()
        context.destroy(linger=0)
        return fail(f"--bind: cannot listen on {args.bind}: {error}", 1)
    if auth is None and not _binds_loopback(args.bind):
        log.warning(
            "listening on %s without --curve-keys: anyone who reaches this port can run requests, bypassing "
            "the gateway's API keys, limits and cache salts; see `kvserve curve-keys`",
            args.bind,
        )
    try:
        transfers, transfer_info = _start_kv_transfers(args, engine, curve)
    except ValueError as error:
        if auth is not None:
            auth.stop()
        context.destroy(linger=0)
        engine.close()
        return fail(str(error), 1)
    index = IndexWriter(
        client,
        executor_id,
        cached_hashes=engine.cached_block_hashes,
        tier_hashes=engine.tier_hashes,
        watch_adapters=engine.serves_adapters,
    )
    service = ExecutorService(engine, socket, index, args.shutdown_grace_period, args.zmq_sndhwm)
    signal.signal(signal.SIGTERM, service.drain)
    signal.signal(signal.SIGINT, service.drain)
    index.register(
        {
            "address": args.advertise_address or args.bind,
            "model": str(engine.model_path),
            "block_size": engine.block_size,
            "kv_blocks_total": engine.stats().kv_blocks_total,
            "max_model_len": engine.max_model_len,
            "max_waiting_seqs": engine.config.max_waiting_seqs,
            "waiting_tenants_share": engine.waiting_tenants_share,
            **transfer_info,
            **engine.adapter_registration(),
        }
    )
    index.start_heartbeat()
    tracing.configure("kvserve-executor")
    log.info(
        "executor %s serving %s on %s (%s)",
        executor_id,
        engine.model_path,
        args.bind,
        f"CURVE: {len(curve.peers)} gateway key(s) let in" if curve else "no CURVE keys: open to any peer",
    )
    try:
        service.run()
    finally:
        try:
            index.deregister()
        except redis.RedisError as error:
            log.warning("deregistering from Redis failed (its keys expire with the heartbeat): %s", error)
        if transfers is not None:
            transfers.close()
        if auth is not None:
            auth.stop()
        socket.close(linger=1000)  # let the last StepBatch messages leave
        context.term()
        tracing.shutdown()
        engine.close()  # the grammar compile process with it
    log.info("executor %s stopped", executor_id)
    return 0


def _port_number(text: str) -> int:
    """An argparse type: a TCP port, or 0 for off."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 (off) to 65535, got {text!r}")
    return int(text)


def _start_kv_transfers(args: argparse.Namespace, engine, curve) -> tuple[object | None, dict[str, str]]:
    """Peer pulls: with a prefix cache this executor pulls what the gateway says a peer holds (with the stack's
    CURVE keys), and publishes its KV fingerprint so the gateway pairs it only with peers of the same KV; with
    --kv-transfer-port it also serves its blocks. The server (or None) and what the registration gains; a
    ValueError says why not."""
    tiers = engine.kv_tiers
    if tiers is None:
        if args.kv_transfer_port:
            raise ValueError("--kv-transfer-port: no prefix cache to serve from (--no-enable-prefix-caching)")
        return None, {}
    from executor.kv.tiers.peer_puller import KVPuller

    tiers.puller = KVPuller(tiers.fingerprint.block_shape, tiers.dtype, curve)
    if not args.kv_transfer_port:
        return None, {"kv_fingerprint": tiers.fingerprint.digest().hex()}
    import zmq

    from executor.kv.tiers.peer_transfer_server import start_executor_transfers, transfer_hosts

    bind_host, publish_host = transfer_hosts(args.bind, args.advertise_address, args.kv_transfer_host)
    try:
        server, info = start_executor_transfers(
            tiers.block_source(),
            tiers.fingerprint.digest(),
            bind_host,
            publish_host,
            args.kv_transfer_port,
            curve,
        )
    except zmq.ZMQError as error:
        raise ValueError(
            f"--kv-transfer-port: cannot listen on {bind_host}:{args.kv_transfer_port}: {error}"
        ) from None
    if curve is None and not is_loopback(bind_host):
        log.warning(
            "serving KV blocks on %s without --curve-keys: anyone who reaches this port can read cached prompts' KV",
            server.address,
        )
    log.info("serving KV blocks to peers on %s, published as %s", server.address, info["kv_transfer_address"])
    return server, info


def _binds_loopback(address: str) -> bool:
    """Whether a ZeroMQ bind address is reachable from this machine only (ipc:// and inproc:// are too)."""
    host = zmq_host(address)
    return host is None or is_loopback(host)


def _open_listener(args: argparse.Namespace) -> str | None:
    """Why this executor, without CURVE keys, may not start: a listener of it that another machine can reach
    (its --bind, or the KV transfer server's host); None when there is none. The gateway's refusal to run open on
    a non-loopback --host, said the same way."""
    listeners = [
        (
            f"--bind {args.bind}",
            zmq_host(args.bind),
            "can run requests, bypassing the gateway's API keys, limits and cache salts",
        )
    ]
    if args.kv_transfer_port:
        from executor.kv.tiers.peer_transfer_server import transfer_hosts

        host, _ = transfer_hosts(args.bind, args.advertise_address, args.kv_transfer_host)
        listeners.append((f"--kv-transfer-host {host}", host, "can read cached prompts' KV"))
    for where, host, exposed in listeners:
        refusal = open_listener_refusal(
            where,
            host,
            "no --curve-keys are given",
            exposed,
            "Give it the stack's keys (`kvserve curve-keys`; --curve-keys or $KVSERVE_CURVE_KEYS)",
            "--allow-insecure-bind",
        )
        if refusal is not None:
            return refusal
    return None
