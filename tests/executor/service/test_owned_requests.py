import logging

from executor.request import Request
from executor.service.owned_requests import Owned, OwnedRequests
from executor.step_result import StepOutput
from shared import protocol
from shared.executor_stats import ExecutorStats
from shared.sampling_params import SamplingParams


def _owned(cached: int, cached_from: dict[str, int]) -> tuple[OwnedRequests, Owned, Request]:
    requests = OwnedRequests("executor-1", ExecutorStats())
    r = Request("r1", list(range(160)), SamplingParams(max_tokens=4))
    r.num_cached_tokens, r.cached_from = cached, cached_from
    owned = Owned(b"gateway", [r], trace_id=None, parent=None)
    requests.add("r1", owned)
    return requests, owned, r


def _ended_line(caplog, cached: int, cached_from: dict[str, int]) -> str:
    requests, _, _ = _owned(cached, cached_from)
    with caplog.at_level(logging.INFO, logger="kvserve.executor"):
        requests.release("r1", "stop")
    return next(rec.getMessage() for rec in caplog.records if "ended" in rec.getMessage())


def test_the_request_log_line_splits_cached_tokens_by_where_their_kv_came_from(caplog):
    line = _ended_line(caplog, 128, {"disk": 32, "peer": 16})
    assert "160 prompt tokens (128 cached: 80 pool, 32 disk, 16 peer)," in line


def test_the_request_log_line_names_only_the_pool_when_no_tier_loaded_and_nothing_when_none_was_cached(
    caplog,
):
    assert "160 prompt tokens (96 cached: 96 pool)," in _ended_line(caplog, 96, {})
    caplog.clear()
    assert "160 prompt tokens (0 cached)," in _ended_line(caplog, -1, {})  # never scheduled


def test_loads_the_scheduler_did_not_count_as_cached_are_cut_from_the_split_the_last_in_the_chain_first(
    caplog,
):
    line = _ended_line(caplog, 48, {"host": 32, "peer": 32})
    assert "(48 cached: 32 host, 16 peer)," in line


def test_updates_carry_the_tiers_share_of_cached_tokens_only_when_there_is_one():
    requests, owned, _ = _owned(64, {"host": 16})
    requests.step_output(owned, StepOutput("r1", [5], [None], None, 64, cached_from={"host": 16}))
    requests.step_output(owned, StepOutput("r1", [6], [None], "stop", 32))
    first, last = requests.take_updates()[b"gateway"]
    assert first.cached_from == {"host": 16} and last.cached_from is None
    # what goes out is what a gateway accepts
    decoded = protocol.decode(protocol.encode(protocol.StepBatch([first, last])))
    assert [u.cached_from for u in decoded.outputs] == [{"host": 16}, None]
