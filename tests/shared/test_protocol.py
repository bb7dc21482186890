import msgpack
import pytest

from shared import protocol
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    GenerateRequest,
    KVPeer,
    ProtocolError,
    RequestError,
    RequestUpdate,
    StepBatch,
    decode,
    encode,
)
from shared.tenant import ANONYMOUS_TENANT, Tenant

MESSAGES = [
    GenerateRequest(
        "req-1",
        [1, 2, 3],
        block_hashes=[b"\x00" * 16, bytes(range(16))],
        sampling={
            "max_tokens": 8,
            "temperature": 0.0,
            "stop": ["\n"],
            "seed": None,
            "logit_bias": {50: -100.0},
        },
        tenant=Tenant("acme", "salt", 2.5),
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        priority=-3,
    ),
    GenerateRequest("req-2", [7]),
    GenerateRequest(
        "req-4",
        list(range(40)),
        block_hashes=[b"\x01" * 16, b"\x02" * 16],
        kv_peer=KVPeer("executor-2", "tcp://10.0.0.2:5601", 2),
    ),
    AbortRequest("req-1"),
    AbortRequest("req-1", index=3),
    StepBatch(
        [
            RequestUpdate("a", [5], [[5, -0.25, 1, [[5, -0.25], [9, -2.5]]]], None, 16),
            RequestUpdate("b", [6, 7], None, "length", 0),
            RequestUpdate("c", [], None, "abort", 0),
            RequestUpdate("d", [], None, "length", 0, [[9, -3.5, 4, [[2, -0.5]]], [4, -0.125, 1, []]]),
            RequestUpdate("d", [8], None, "stop", 0, index=7),
            RequestUpdate("e", [9], None, "stop", 32, kv_block_seconds=0.75),
            RequestUpdate("f", [], None, "abort", 0, kv_block_seconds=0.0),
            RequestUpdate("g", [3], None, None, 96, cached_from={"host": 16, "disk": 32, "peer": 48}),
        ]
    ),
    StepBatch([]),
    RequestError("req-3", "prompt_token_ids: token id 99999 is outside the vocabulary", 400),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    assert decode(data) == msg


def test_a_tenant_rides_as_its_three_keys_and_nil_names_the_anonymous_one():
    request = GenerateRequest("r", [1], tenant=Tenant("acme", "salt", 2.5), priority=4)
    body = msgpack.unpackb(encode(request))
    wire = {key: body[key] for key in ("tenant", "cache_salt", "tenant_weight", "priority")}
    assert wire == {"tenant": "acme", "cache_salt": "salt", "tenant_weight": 2.5, "priority": 4}
    assert decode(encode(request)).tenant.weight == 2.5  # the weight is no part of a tenant's equality
    anonymous = GenerateRequest("r", [1])
    assert msgpack.unpackb(encode(anonymous))["tenant"] is None
    assert decode(encode(anonymous)).tenant == ANONYMOUS_TENANT
    named_so = Tenant("anonymous", "salt")  # a key's tenant may be called that, and stays itself
    assert decode(encode(GenerateRequest("r", [1], tenant=named_so))).tenant == named_so != ANONYMOUS_TENANT
    for weight in (0, -1.0, 1000.5, "2", True, float("nan")):
        with pytest.raises(ProtocolError, match=r"'tenant_weight' must be a number in \(0, 1000\]"):
            decode(
                _raw(
                    v=PROTOCOL_VERSION,
                    type="generate",
                    request_id="r",
                    prompt_token_ids=[1],
                    tenant_weight=weight,
                )
            )


def test_every_map_carries_version_and_type():
    for msg in MESSAGES:
        body = msgpack.unpackb(encode(msg), strict_map_key=False)  # logit_bias is keyed by token id
        assert body["v"] == PROTOCOL_VERSION and body["type"] == msg.TYPE


def _raw(**body):
    return msgpack.packb(body, use_bin_type=True)


def _step(**output):
    """A step message with one update for request "a"."""
    update = {"request_id": "a", "num_cached_tokens": 0, "seq": 0, **output}
    return _raw(v=PROTOCOL_VERSION, type="step", outputs=[update])


def test_version_mismatch_is_refused_with_a_clear_error():
    with pytest.raises(
        ProtocolError, match=rf"protocol version 1 from peer, this side speaks {PROTOCOL_VERSION}"
    ):
        decode(_raw(v=1, type="abort", request_id="r"))  # 1 had no RequestUpdate.seq
    with pytest.raises(ProtocolError, match="protocol version None from peer") as info:
        decode(_raw(type="abort", request_id="r"))
    assert info.value.request_id == "r"  # so the executor can still answer that request
    with pytest.raises(ProtocolError, match="protocol version True"):
        decode(_raw(v=True, type="abort", request_id="r"))  # msgpack true is not version 1


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xc1garbage", "not a msgpack message"),
        (b"", "not a msgpack message"),
        (msgpack.packb([1, 2]), "expected a msgpack map, got list"),
        (_raw(v=PROTOCOL_VERSION, type="launch"), "unknown message type 'launch'"),
        (_raw(v=PROTOCOL_VERSION), "unknown message type None"),
        (_raw(v=PROTOCOL_VERSION, type="generate", request_id="r"), "missing field 'prompt_token_ids'"),
        (
            _raw(v=PROTOCOL_VERSION, type="generate", request_id="r", prompt_token_ids=[1, "2"]),
            "field 'prompt_token_ids' must be a list of integers",
        ),
        (
            _raw(
                v=PROTOCOL_VERSION, type="generate", request_id="r", prompt_token_ids=[1], block_hashes=["ab"]
            ),
            "field 'block_hashes' must be a list of binary strings",
        ),
        (
            _raw(v=PROTOCOL_VERSION, type="generate", request_id="r", prompt_token_ids=[1], sampling=[1]),
            "field 'sampling' must be a map",
        ),
        (_raw(v=PROTOCOL_VERSION, type="abort", request_id=7), "field 'request_id' must be a string"),
        (
            _raw(v=PROTOCOL_VERSION, type="error", request_id="r", message="m", code="400"),
            "'code' must be an integer",
        ),
        (_raw(v=PROTOCOL_VERSION, type="step", outputs=[1]), r"outputs\[0\] must be a map"),
        (
            _step(token_ids=[1], logprobs=[[1, 0.5]], finish_reason=None),
            "field 'logprobs' must be nil or a list of",
        ),
        (
            _step(token_ids=[], logprobs=None, finish_reason="length", prompt_logprobs=[None]),
            "field 'prompt_logprobs' must be nil or a list of",
        ),
        *(
            (
                _step(token_ids=[], logprobs=None, finish_reason="stop", kv_block_seconds=bad),
                "field 'kv_block_seconds' must be nil or a finite number >= 0",
            )
            for bad in (-1.0, "2.5", float("inf"), float("nan"), True)
        ),
    ],
)
def test_malformed_messages_are_refused_naming_the_problem(data, message):
    with pytest.raises(ProtocolError, match=message):
        decode(data)


def test_a_malformed_request_keeps_its_id_for_the_answer():
    with pytest.raises(ProtocolError) as info:
        decode(_raw(v=PROTOCOL_VERSION, type="generate", request_id="r9", prompt_token_ids="hello"))
    assert info.value.request_id == "r9"


def test_unknown_keys_are_ignored_so_fields_can_be_added_within_a_version():
    assert decode(_raw(v=PROTOCOL_VERSION, type="abort", request_id="r", priority=3)) == AbortRequest("r")


def test_choice_indexes_default_for_peers_that_send_none_and_are_checked():
    update = {
        "request_id": "a",
        "token_ids": [1],
        "logprobs": None,
        "finish_reason": None,
        "num_cached_tokens": 0,
        "seq": 0,
    }
    step = decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update]))
    assert step.outputs[0].index == 0  # an older executor streams one choice, the first
    assert decode(_raw(v=PROTOCOL_VERSION, type="abort", request_id="r")).index is None  # every choice
    with pytest.raises(ProtocolError, match="'index' must be an integer >= 0"):
        decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update | {"index": -1}]))
    with pytest.raises(ProtocolError, match="'index' must be nil or an integer >= 0"):
        decode(_raw(v=PROTOCOL_VERSION, type="abort", request_id="r", index="1"))


def test_kv_block_seconds_rides_only_on_a_requests_last_update_and_older_peers_send_none():
    running = RequestUpdate("a", [1], None, None, 0)
    last = RequestUpdate("a", [2], None, "stop", 0, kv_block_seconds=1.5)
    body = msgpack.unpackb(encode(StepBatch([running, last])))
    assert "kv_block_seconds" not in body["outputs"][0] and body["outputs"][1]["kv_block_seconds"] == 1.5
    update = {
        "request_id": "a",
        "token_ids": [],
        "logprobs": None,
        "finish_reason": "stop",
        "num_cached_tokens": 0,
        "seq": 0,
    }
    step = decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update]))
    assert step.outputs[0].kv_block_seconds is None  # an older executor: nothing to bill for its KV


def test_cached_tokens_by_source_ride_only_where_a_tier_or_peer_supplied_some_and_older_peers_send_none():
    from_pool = RequestUpdate("a", [1], None, None, 64)
    loaded = RequestUpdate("b", [1], None, None, 64, cached_from={"disk": 48})
    body = msgpack.unpackb(encode(StepBatch([from_pool, loaded])))
    assert "cached_from" not in body["outputs"][0] and body["outputs"][1]["cached_from"] == {"disk": 48}
    older = {
        "request_id": "a",
        "token_ids": [1],
        "logprobs": None,
        "finish_reason": None,
        "num_cached_tokens": 64,
    }
    step = decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[older | {"seq": 0}]))
    assert step.outputs[0].cached_from is None  # all 64 were the pool's


@pytest.mark.parametrize(
    "cached_from",
    [
        {"pool": 16},  # never sent: the pool's share is what the others leave
        {"ram": 16},
        {"host": -1},
        {"host": 1.5},
        {"disk": True},
        {"host": "16"},
        {"host": 48, "peer": 32},  # more than the 64 cached
        [16, 0, 0],
        "host",
    ],
)
def test_cached_tokens_by_source_are_refused_unless_tier_counts_fit_within_the_cached_tokens(cached_from):
    with pytest.raises(ProtocolError, match="field 'cached_from' must be nil or a map of host/disk/peer"):
        decode(
            _step(
                token_ids=[1],
                logprobs=None,
                finish_reason=None,
                num_cached_tokens=64,
                cached_from=cached_from,
            )
        )


def test_shared_protocol_imports_neither_side():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(protocol.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"gateway", "executor"}


def test_updates_carry_their_sequence_number_which_is_required_and_checked():
    update = {
        "request_id": "a",
        "token_ids": [1],
        "logprobs": None,
        "finish_reason": None,
        "num_cached_tokens": 0,
    }
    assert decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update | {"seq": 7}])).outputs[0].seq == 7
    with pytest.raises(ProtocolError, match="missing field 'seq'"):  # without it a lost update goes unseen
        decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update]))
    with pytest.raises(ProtocolError, match="'seq' must be an integer >= 0"):
        decode(_raw(v=PROTOCOL_VERSION, type="step", outputs=[update | {"seq": -1}]))


def test_the_message_bound_holds_the_largest_legitimate_messages():
    """A prompt from the gateway's largest body, one token per byte, with every bounded field at its limit; and
    the prompt logprobs of a 128k-token prompt: both fit under MAX_MESSAGE_BYTES."""
    from gateway.openai.body import MAX_BODY_BYTES
    from gateway.openai.request_limits import DEFAULT_LIMITS as limits

    prompt = [2**31 - 1] * MAX_BODY_BYTES  # the widest token id msgpack writes in 5 bytes
    sampling = {
        "logit_bias": {2**31 - 1 - i: -100.0 for i in range(limits.max_logit_bias)},
        "stop": ["\U0001f600" * limits.max_stop_string_chars] * limits.max_stop_strings,
        "structured_outputs": {"grammar": "x" * limits.max_grammar_bytes},
    }
    hashes = [bytes(16)] * (len(prompt) // 16)
    request = GenerateRequest("r" * 64, prompt, hashes, sampling, Tenant("t" * 64, "s" * 64), "0" * 55)
    top = [[2**31 - 1, -1.0e-300]] * 20
    update = RequestUpdate(
        "r" * 64, [1], None, None, 0, [[2**31 - 1, -1.0e-300, 2**31 - 1, top]] * 128 * 1024
    )
    sizes = {"generate": len(encode(request)), "prompt logprobs": len(encode(StepBatch([update])))}
    assert max(sizes.values()) < protocol.MAX_MESSAGE_BYTES, sizes


def _with_peer(peer, num_hashes: int = 2) -> bytes:
    hashes = [bytes([i]) * 16 for i in range(num_hashes)]
    return _raw(
        v=PROTOCOL_VERSION,
        type="generate",
        request_id="r",
        prompt_token_ids=[1] * 40,
        block_hashes=hashes,
        kv_peer=peer,
    )


def test_a_kv_peer_rides_as_a_small_map_absent_when_there_is_none():
    peer = KVPeer("executor-2", "tcp://10.0.0.2:5601", 1)
    body = msgpack.unpackb(encode(GenerateRequest("r", [1] * 40, [b"\x00" * 16], kv_peer=peer)))
    assert body["kv_peer"] == {"executor_id": "executor-2", "address": "tcp://10.0.0.2:5601", "num_blocks": 1}
    assert "kv_peer" not in msgpack.unpackb(
        encode(GenerateRequest("r", [1]))
    )  # older executors see nothing new
    assert decode(_with_peer(None)).kv_peer is None


GOOD_PEER = {"executor_id": "executor-2", "address": "tcp://10.0.0.2:5601", "num_blocks": 2}


@pytest.mark.parametrize(
    "peer, message",
    [
        ("tcp://10.0.0.2:5601", "field 'kv_peer' must be nil or a map"),
        (
            {**GOOD_PEER, "address": "ipc:///tmp/kv"},
            "kv_peer message: field 'address' must be a tcp:// endpoint",
        ),
        (
            {**GOOD_PEER, "address": "tcp://" + "h" * 251},
            "kv_peer message: field 'address' must be a tcp:// endpoint",
        ),
        ({**GOOD_PEER, "executor_id": "a:blocks"}, "kv_peer message: field 'executor_id' must be 1-128 of"),
        ({**GOOD_PEER, "executor_id": 7}, "kv_peer message: field 'executor_id' must be 1-128 of"),
        (
            {**GOOD_PEER, "num_blocks": 0},
            r"kv_peer message: field 'num_blocks' must be an integer in \[1, 2\]",
        ),
        (
            {**GOOD_PEER, "num_blocks": 3},
            r"kv_peer message: field 'num_blocks' must be an integer in \[1, 2\]",
        ),
        ({**GOOD_PEER, "num_blocks": True}, "kv_peer message: field 'num_blocks' must be an integer"),
        ({"executor_id": "executor-2", "num_blocks": 1}, "kv_peer message: missing field 'address'"),
    ],
)
def test_a_bad_kv_peer_is_refused_naming_its_field(peer, message):
    with pytest.raises(ProtocolError, match=message) as refused:
        decode(_with_peer(peer))
    assert refused.value.request_id == "r"  # answered as a 400, not dropped
    assert decode(_with_peer({**GOOD_PEER, "address": "tcp://" + "h" * 250})).kv_peer.num_blocks == 2
