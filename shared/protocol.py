"""The wire protocol between gateway and executor: msgpack maps over ZeroMQ, each with a version and a type.

Gateway -> executor: `GenerateRequest`, `AbortRequest`, and a `GatewayHeartbeat` every GATEWAY_HEARTBEAT_S.
Executor -> gateway: one `StepBatch` per gateway per engine step, and `RequestError` for a request that was
refused. Every map carries `"v"` (PROTOCOL_VERSION) and `"type"`; a peer speaking another version, or sending
something that is not one of these messages, is refused with a `ProtocolError` that says why. Keys a message
does not know are ignored, so a field can be added within a version without breaking older peers.

Streams are exact or fail loudly: each request's updates are numbered (`RequestUpdate.seq`), so a receiver that
misses one knows it; and no message is larger than MAX_MESSAGE_BYTES, which every ZeroMQ socket of either side
enforces (ZMQ_MAXMSGSIZE: a peer sending more is disconnected, never buffered).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from shared.adapter_names import is_adapter_name
from shared.cache_sources import LOADED_SOURCES, is_loaded_tokens
from shared.redis_keys import check_executor_id
from shared.tenant import ANONYMOUS_TENANT, MAX_TENANT_WEIGHT, Tenant
from shared.wire_fields import Fields, ProtocolError

PROTOCOL_VERSION = 2  # 2: RequestUpdate.seq, which the gateway needs to see a lost update
# The largest message either side sends or accepts (ZMQ_MAXMSGSIZE on every socket). The largest legitimate ones:
# - a generate request whose prompt came from the gateway's largest body (4 MiB, gateway.openai.body's
#   MAX_BODY_BYTES): at most ~4M token ids (a byte-level BPE token covers at least one byte of text; a token-id
#   prompt's JSON is larger than its msgpack) of <= 5 bytes each, plus an 18-byte hash per 16-token block: ~25 MiB;
#   its other bounded fields (300 logit_bias entries, 64 stop strings of 256 characters, a 64 KiB grammar) add
#   < 1 MiB (gateway.openai.request_limits);
# - an update carrying the prompt logprobs of a 128k-token prompt with 20 top entries each (~340 bytes a token):
#   ~44 MiB. The executor splits a step's batch that would be larger, and fails a request whose one update is.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_PRIORITY = 2**31  # a request's priority is within +- this
MAX_PEER_ADDRESS = 256  # a KV peer's endpoint is at most this many characters (a host name is at most 253)

# logprobs of one generated token: [token_id, logprob, rank, [[token_id, logprob], ...]] (top entries, best first)
TokenLogprobsWire = list


@dataclass(frozen=True, slots=True)
class KVPeer:
    """Another executor that holds the prompt's first num_blocks blocks (in its pool or a KV tier) and serves them
    on its KV transfer server at address: the executor pulls those past its own cached run instead of computing
    them (the gateway's router chose it, gateway/routing/router.py)."""

    executor_id: str
    address: str  # tcp://host:port, the peer's kv_transfer_address in Redis
    num_blocks: int


@dataclass(slots=True)
class GenerateRequest:
    TYPE: ClassVar[str] = "generate"

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes] = field(
        default_factory=list
    )  # the prompt's full-block chain (shared.block_hash)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields by name
    # whose it is; on the wire as three keys: tenant (its name, nil for the anonymous one), cache_salt and
    # tenant_weight
    tenant: Tenant = ANONYMOUS_TENANT
    traceparent: str | None = None  # W3C trace context, so one trace spans both processes
    # the request's own, not its tenant's: within its tenant, lower first (vLLM's `priority`)
    priority: int = 0
    # where to pull the prompt's KV blocks from that this executor lacks; on the wire a map of the three fields,
    # absent when None (an older executor ignores it and computes them)
    kv_peer: KVPeer | None = None
    # the LoRA adapter it runs under, by name (None: the base model); absent from the wire when None
    lora: str | None = None


@dataclass(slots=True)
class AbortRequest:
    TYPE: ClassVar[str] = "abort"

    request_id: str
    index: int | None = None  # n > 1: only this choice (a stop string ended it); None: every choice


@dataclass(slots=True)
class GatewayHeartbeat:
    """The gateway still reads what it asked for: an executor that has had one from a gateway and then hears
    nothing from it for GATEWAY_SILENCE_S aborts its requests (executor/service/gateway_liveness.py)."""

    TYPE: ClassVar[str] = "heartbeat"


GATEWAY_HEARTBEAT_S = 1.0
# four missed heartbeats: a gateway whose event loop is only slow keeps its requests
GATEWAY_SILENCE_S = 4.0


@dataclass(slots=True)
class RequestUpdate:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new tokens only
    logprobs: list[TokenLogprobsWire | None] | None  # one entry per new token; None when not asked for
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int
    # sampling prompt_logprobs: every prompt token's but the first (which has none), in order, once, with the
    # request's first update that has tokens (or its end); each entry at most MAX_PROMPT_LOGPROBS top entries
    prompt_logprobs: list[TokenLogprobsWire] | None = None
    index: int = 0  # which choice of the request (n > 1); absent from older peers, which send one choice
    # KV blocks the request held x seconds, all its choices together, for its tenant's bill: only on its last
    # update (the first of them when an abort ends several choices at once), None on the others and from older
    # peers. A block holds --block-size tokens' KV, so x block size is token-seconds.
    kv_block_seconds: float | None = None
    # of num_cached_tokens, those loaded from a tier below the pool or pulled from a peer, by source (shared.
    # cache_sources): on every update, like num_cached_tokens, when there are any; None otherwise and from older peers
    cached_from: dict[str, int] | None = None
    # the request's updates numbered from 0 in the order its executor sent them, all choices together: a gap
    # means updates were lost on the way, and the stream cannot be completed as it was generated
    seq: int = 0


def accepted(request_id: str) -> RequestUpdate:
    """The update saying an executor took the request but holds it outside its waiting queue (waiting for its
    grammar): the gateway stops counting it against that queue's places, and the client sees nothing of it."""
    return RequestUpdate(request_id, [], None, None, 0)


def is_acceptance(update: RequestUpdate) -> bool:
    return not update.token_ids and update.finish_reason is None and update.prompt_logprobs is None


@dataclass(slots=True)
class StepBatch:
    TYPE: ClassVar[str] = "step"

    outputs: list[RequestUpdate]


@dataclass(slots=True)
class RequestError:
    TYPE: ClassVar[str] = "error"

    request_id: str
    message: str
    code: int  # HTTP-like: 400 bad input, 429 busy (BUSY), 503 draining, 500 internal fault


# RequestError codes that mean "nothing was started here, send it to another executor"
BUSY = 429  # the executor's waiting queue is at its bound (back-pressure)
DRAINING = 503  # the executor is shutting down
REROUTABLE = frozenset({BUSY, DRAINING})
# the executor ended the request because its updates could not be delivered (its gateway fell too far behind
# reading them, or one was larger than MAX_MESSAGE_BYTES): the gateway handles it as a lost executor
UNDELIVERABLE = 502

Message = GenerateRequest | AbortRequest | GatewayHeartbeat | StepBatch | RequestError


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    if isinstance(msg, StepBatch):
        body["outputs"] = [_update_fields(update) for update in msg.outputs]
    elif isinstance(msg, GenerateRequest):
        body.update(_generate_fields(msg))
    else:
        body.update(_fields(msg))
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias maps token ids
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not a msgpack message ({type(error).__name__}: {error})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"expected a msgpack map, got {type(body).__name__}")
    request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    version = body.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            f"protocol version {version!r} from peer, this side speaks {PROTOCOL_VERSION}", request_id
        )
    kind = body.get("type")
    read = _READERS.get(kind) if isinstance(kind, str) else None
    if read is None:
        raise ProtocolError(f"unknown message type {kind!r} (known: {', '.join(_READERS)})", request_id)
    return read(Fields(body, kind, request_id))


def _fields(msg) -> dict[str, Any]:
    return {name: getattr(msg, name) for name in msg.__slots__}


def _generate_fields(request: GenerateRequest) -> dict[str, Any]:
    fields = _fields(request)
    tenant = fields.pop("tenant")
    name = None if tenant == ANONYMOUS_TENANT else tenant.name  # nil, as the wire has always named it
    fields.update(tenant=name, cache_salt=tenant.cache_salt, tenant_weight=tenant.weight)
    peer = fields.pop("kv_peer")
    if peer is not None:
        fields["kv_peer"] = _fields(peer)
    if fields["lora"] is None:
        del fields["lora"]
    return fields


def _update_fields(update: RequestUpdate) -> dict[str, Any]:
    fields = _fields(update)
    for name in ("kv_block_seconds", "cached_from"):  # unset (kv_block_seconds on all but a request's last)
        if fields[name] is None:
            del fields[name]  # off the wire
    return fields


# -- reading, with a clear error for each field that is missing or of the wrong type -----------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _logprobs_entry(value: object) -> bool:
    return value is None or (
        isinstance(value, list)
        and len(value) == 4
        and _is_int(value[0])
        and isinstance(value[1], float | int)
        and _is_int(value[2])
        and isinstance(value[3], list)
        and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) for p in value[3])
    )


def _logprobs_list(value: object, entry_may_be_nil: bool = True) -> bool:
    if value is None:
        return True
    return isinstance(value, list) and all(
        _logprobs_entry(e) and (entry_may_be_nil or e is not None) for e in value
    )


def _read_generate(f: Fields) -> GenerateRequest:
    block_hashes = f.get(
        "block_hashes",
        lambda v: isinstance(v, list) and all(isinstance(h, bytes) for h in v),
        "a list of binary strings",
        [],
    )
    return GenerateRequest(
        request_id=f.text("request_id"),
        prompt_token_ids=f.get("prompt_token_ids", _int_list, "a list of integers"),
        block_hashes=block_hashes,
        sampling=f.get("sampling", lambda v: isinstance(v, dict), "a map of sampling parameters", {}),
        tenant=_read_tenant(f),
        priority=f.get(
            "priority", lambda v: _is_int(v) and abs(v) <= MAX_PRIORITY, "an integer in +-2**31", 0
        ),
        traceparent=f.optional_text("traceparent"),
        kv_peer=_read_kv_peer(f, len(block_hashes)),
        lora=f.get("lora", lambda v: v is None or is_adapter_name(v), "nil or an adapter name", None),
    )


def _is_executor_id(value: object) -> bool:
    try:
        return isinstance(value, str) and bool(check_executor_id(value))
    except ValueError:
        return False


def is_peer_address(value: object) -> bool:
    """What an executor accepts as a KV peer's address (the gateway sends no other)."""
    return isinstance(value, str) and value.startswith("tcp://") and len(value) <= MAX_PEER_ADDRESS


def _read_kv_peer(f: Fields, num_hashes: int) -> KVPeer | None:
    """Checked before the executor connects anywhere: a tcp:// endpoint of bounded length, and a run of blocks
    the request's own hash chain names (the pull asks the peer for those hashes)."""
    peer = f.get("kv_peer", lambda v: v is None or isinstance(v, dict), "nil or a map", None)
    if peer is None:
        return None
    p = Fields(peer, f"{f.kind} kv_peer", f.request_id)
    return KVPeer(
        executor_id=p.get("executor_id", _is_executor_id, "1-128 of A-Z a-z 0-9 _ . -"),
        address=p.get(
            "address", is_peer_address, f"a tcp:// endpoint of at most {MAX_PEER_ADDRESS} characters"
        ),
        num_blocks=p.get(
            "num_blocks",
            lambda v: _is_int(v) and 0 < v <= num_hashes,
            f"an integer in [1, {num_hashes}] (the request's block hashes)",
        ),
    )


def _read_tenant(f: Fields) -> Tenant:
    """From its three keys; no name (nil) is the anonymous tenant."""
    name = f.optional_text("tenant")
    weight = f.get(
        "tenant_weight",
        lambda v: _is_number(v) and 0 < v <= MAX_TENANT_WEIGHT,
        "a number in (0, 1000]",
        1.0,
    )
    return Tenant(ANONYMOUS_TENANT.name if name is None else name, f.optional_text("cache_salt"), weight)


def _read_abort(f: Fields) -> AbortRequest:
    index = f.get("index", lambda v: v is None or (_is_int(v) and v >= 0), "nil or an integer >= 0", None)
    return AbortRequest(request_id=f.text("request_id"), index=index)


def _read_step(f: Fields) -> StepBatch:
    outputs = f.get("outputs", lambda v: isinstance(v, list), "a list")
    updates = []
    for i, item in enumerate(outputs):
        if not isinstance(item, dict):
            raise ProtocolError(f"step message: outputs[{i}] must be a map, got {item!r:.80}")
        u = Fields(item, f"step message outputs[{i}]", None)
        num_cached_tokens = u.get("num_cached_tokens", _is_int, "an integer")
        updates.append(
            RequestUpdate(
                request_id=u.text("request_id"),
                token_ids=u.get("token_ids", _int_list, "a list of integers"),
                logprobs=u.get(
                    "logprobs",
                    _logprobs_list,
                    "nil or a list of [token_id, logprob, rank, top] entries",
                ),
                finish_reason=u.optional_text("finish_reason"),
                num_cached_tokens=num_cached_tokens,
                prompt_logprobs=u.get(
                    "prompt_logprobs",
                    functools.partial(_logprobs_list, entry_may_be_nil=False),
                    "nil or a list of [token_id, logprob, rank, top] entries",
                    None,
                ),
                index=u.get("index", lambda v: _is_int(v) and v >= 0, "an integer >= 0", 0),
                kv_block_seconds=u.get(
                    "kv_block_seconds",
                    lambda v: v is None or (_is_number(v) and 0 <= v < math.inf),
                    "nil or a finite number >= 0",
                    None,
                ),
                cached_from=u.get(
                    "cached_from",
                    functools.partial(is_loaded_tokens, num_cached_tokens=num_cached_tokens),
                    f"nil or a map of {'/'.join(LOADED_SOURCES)} to integers >= 0 summing to <= num_cached_tokens",
                    None,
                ),
                seq=u.get("seq", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
            )
        )
    return StepBatch(outputs=updates)


def _read_error(f: Fields) -> RequestError:
    return RequestError(
        request_id=f.text("request_id"),
        message=f.text("message"),
        code=f.get("code", _is_int, "an integer"),
    )


_READERS: dict[str, Callable[[Fields], Message]] = {
    GenerateRequest.TYPE: _read_generate,
    AbortRequest.TYPE: _read_abort,
    GatewayHeartbeat.TYPE: lambda _f: GatewayHeartbeat(),
    StepBatch.TYPE: _read_step,
    RequestError.TYPE: _read_error,
}
