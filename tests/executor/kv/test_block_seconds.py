"""KV block-seconds per request, on a real block pool and KV cache manager, with a clock the test moves."""

from executor.kv.block_pool import BlockPool
from executor.kv.block_seconds import KVBlockSeconds
from executor.kv.cache_manager import KVCacheManager
from executor.request import Request
from shared.sampling_params import SamplingParams

SECOND = 10**9
PROMPT = list(range(40))  # two full blocks of 16 and a partly filled third


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _setup():
    clock = Clock()
    kv = KVCacheManager(BlockPool(64), block_size=16)
    return clock, kv, KVBlockSeconds(kv, clock)


def _prefill(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens


def test_a_request_is_charged_its_blocks_times_the_seconds_it_held_them_and_nothing_after_its_end():
    clock, kv, meter = _setup()
    request = Request("a", PROMPT, SamplingParams())
    _prefill(kv, request)
    meter.charge([request])  # holds 3 blocks from now
    clock.ns += 2 * SECOND
    request.append_token(7)  # 41 tokens: still 3 blocks
    meter.charge([request])
    assert request.kv_block_seconds == 6.0
    for token in range(8):  # 49 tokens: a fourth block
        request.append_token(token)
    assert kv.allocate(request, request.num_tokens - request.num_computed_tokens)
    meter.charge([request])
    clock.ns += SECOND // 2
    meter.settle(request)  # it ends half a second later
    kv.free(request)
    assert request.kv_block_seconds == 8.0
    clock.ns += 10 * SECOND
    meter.charge([])
    assert request.kv_block_seconds == 8.0


def test_parallel_sampling_pays_once_for_the_prompt_blocks_its_choices_share():
    clock, kv, meter = _setup()
    params = SamplingParams(n=3)
    choices = [Request(f"g/{i}", PROMPT, params, group_id="g", index=i) for i in range(3)]
    _prefill(kv, choices[0])
    for child in choices[1:]:
        child.num_computed_tokens = choices[0].num_computed_tokens
        kv.fork(choices[0], child)
    for choice in choices:  # each writes its first token: the shared partly filled block is copied
        choice.append_token(1)
        assert kv.allocate(choice, 1)
    distinct = {block.block_id for choice in choices for block in kv.tables[choice.request_id]}
    assert len(distinct) == 2 + 3  # the two full prompt blocks, and a last block each
    meter.charge(choices)
    clock.ns += SECOND
    meter.charge(choices)
    assert sum(c.kv_block_seconds for c in choices) == len(distinct)
    # the choice that paid for the prompt ends: another pays for it from the next charge
    meter.settle(choices[0])
    kv.free(choices[0])
    meter.charge(choices[1:])
    clock.ns += SECOND
    meter.charge(choices[1:])
    assert sum(c.kv_block_seconds for c in choices) == len(distinct) + 2 + 2
