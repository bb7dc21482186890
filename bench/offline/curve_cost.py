"""What CURVE costs on the gateway-executor wire: the same DEALER -> ROUTER -> DEALER round trips over TCP
loopback, plain and with CURVE keys (shared/curve_keys.py, as the executor and gateway set them), for the
messages kvserve sends: a GenerateRequest of a 512-token prompt, and a StepBatch of 16 one-token updates (a
decode step's message to one gateway). Rounds alternate plain and CURVE so the machine's load hits both.

    python -m bench.offline.curve_cost [--round-trips 2000] [--rounds 3]

Reports per message kind the median and p99 round trip in microseconds, and how many one-way StepBatch
messages a second one socket carries (streamed, no waiting for replies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import zmq

from kvserve.curve_keys_cli import write_keys
from shared import protocol
from shared.block_hash import hash_blocks
from shared.curve_keys import load_executor_keys, load_gateway_keys, secure_client, secure_server


def messages() -> dict[str, bytes]:
    prompt = list(range(1000, 1512))
    generate = protocol.GenerateRequest(
        "0123456789abcdef0123456789abcdef", prompt, hash_blocks(prompt, 16), {"max_tokens": 128}
    )
    step = protocol.StepBatch(
        [protocol.RequestUpdate(f"{i:032x}", [1234 + i], None, None, 0) for i in range(16)]
    )
    return {"generate_512": protocol.encode(generate), "step_16": protocol.encode(step)}


def pair(context: zmq.Context, keys_dir: Path | None) -> tuple[zmq.Socket, zmq.Socket]:
    """(gateway DEALER, executor ROUTER), connected and past the handshake."""
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    # a ROUTER drops what passes its high-water mark: let the streamed burst queue whole
    router.sndhwm = dealer.rcvhwm = 0
    router.maxmsgsize = dealer.maxmsgsize = protocol.MAX_MESSAGE_BYTES
    if keys_dir is not None:
        secure_server(router, load_executor_keys(keys_dir))  # no ZAP handler: it only acts at the handshake
        secure_client(dealer, load_gateway_keys(keys_dir))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    router.send_multipart([identity, b"hello"])
    dealer.recv()
    return dealer, router


def round_trips(dealer: zmq.Socket, router: zmq.Socket, payload: bytes, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        dealer.send(payload)
        identity, got = router.recv_multipart()
        router.send_multipart([identity, got])
        dealer.recv()
        times.append(time.perf_counter() - started)
    return times


def streamed(dealer: zmq.Socket, router: zmq.Socket, payload: bytes, n: int) -> float:
    """Messages a second from executor to gateway, as a decode loop sends them."""
    dealer.send(b"who")
    identity, _ = router.recv_multipart()
    started = time.perf_counter()
    for _ in range(n):
        router.send_multipart([identity, payload])
    for _ in range(n):
        dealer.recv()
    return n / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    keys_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-curve-"))
    write_keys(keys_dir)
    context = zmq.Context()
    samples: dict[str, dict[str, list[float]]] = {"plain": {}, "curve": {}}
    rates: dict[str, list[float]] = {"plain": [], "curve": []}
    for _ in range(args.rounds):
        for mode in ("plain", "curve"):
            dealer, router = pair(context, keys_dir if mode == "curve" else None)
            for name, payload in messages().items():
                samples[mode].setdefault(name, []).extend(
                    round_trips(dealer, router, payload, args.round_trips)
                )
            rates[mode].append(streamed(dealer, router, messages()["step_16"], args.round_trips * 5))
            dealer.close(linger=0)
            router.close(linger=0)
    context.term()
    report = {"message_bytes": {name: len(payload) for name, payload in messages().items()}}
    for mode in ("plain", "curve"):
        report[mode] = {
            name: {
                "rtt_p50_us": round(statistics.median(times) * 1e6, 1),
                "rtt_p99_us": round(statistics.quantiles(times, n=100)[98] * 1e6, 1),
            }
            for name, times in samples[mode].items()
        }
        report[mode]["step_16_streamed_msgs_per_s"] = round(statistics.median(rates[mode]))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
