"""The requests an executor runs for its gateways, and what each is owed: its updates in order (a seq each, held
per gateway until the service loop sends them), and at its end the counts, log line and spans of what it cost.

The loop (loop.py) decides when a request starts, aborts or fails; this module keeps the books on it.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.service.phase_spans import record_request_spans
from shared import protocol
from shared.cache_sources import by_source, loaded_tokens
from shared.executor_stats import ExecutorStats

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from executor.request import Request
    from executor.sampling.sampler import TokenLogprobs
    from executor.step_result import StepOutput

log = logging.getLogger("kvserve.executor")

# ends of requests this executor never ran: another executor serves them, or none does
NOT_RUN_HERE = frozenset({"refused", "handed back"})


@dataclass(slots=True)
class Owned:
    """A request running here for a gateway."""

    identity: bytes  # the gateway's ZeroMQ identity
    choices: list[Request]  # every choice (n > 1), as add_request handed them: what its end reports
    trace_id: str | None  # from the gateway's traceparent, for log lines, with tracing on or off
    parent: Context | None  # the gateway's span, only while tracing is on: its spans go out when it ends
    next_seq: int = 0  # the seq of its next update (protocol.RequestUpdate.seq)
    prefilled: bool = False  # its first token went out: its prompt and time to first token are counted


class OwnedRequests:
    def __init__(self, executor_id: str, stats: ExecutorStats) -> None:
        self.executor_id = executor_id  # names this executor in a traced request's spans
        self.owners: dict[str, Owned] = {}  # by request id
        self.outbox: dict[bytes, list[protocol.RequestUpdate]] = defaultdict(list)
        # the service's stats: the token counts and latencies counted here go into them
        self.stats = stats

    def add(self, request_id: str, owned: Owned) -> None:
        self.owners[request_id] = owned

    def get(self, request_id: str) -> Owned | None:
        return self.owners.get(request_id)

    def of_gateway(self, identity: bytes) -> set[str]:
        return {request_id for request_id, owned in self.owners.items() if owned.identity == identity}

    def emit(self, owned: Owned, update: protocol.RequestUpdate) -> None:
        update.seq, owned.next_seq = owned.next_seq, owned.next_seq + 1
        self.outbox[owned.identity].append(update)

    def take_updates(self) -> dict[bytes, list[protocol.RequestUpdate]]:
        """Every update emitted since the last call, per gateway, in the order emitted."""
        updates, self.outbox = self.outbox, defaultdict(list)
        return updates

    def step_output(self, owned: Owned, out: StepOutput) -> None:
        """A choice's new tokens from a step, as one update; the group's last also says what its KV held."""
        logprobs = None
        self._count_tokens(owned, out)
        if any(lp is not None for lp in out.new_logprobs):
            logprobs = [_wire_logprobs(lp) for lp in out.new_logprobs]
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [_wire_logprobs(lp) for lp in out.prompt_logprobs]
        self.emit(
            owned,
            protocol.RequestUpdate(
                out.request_id,
                out.new_token_ids,
                logprobs,
                out.finish_reason,
                out.num_cached_tokens,
                prompt_logprobs=prompt_logprobs,
                index=out.index,
                kv_block_seconds=kv_block_seconds(owned) if out.group_finished else None,
                cached_from=loaded_tokens(out.num_cached_tokens, out.cached_from) or None,
            ),
        )

    def aborted(self, request_id: str, indexes: list[int], ended: bool) -> None:
        """An update for each aborted choice; when none of the request runs on (`ended`), the first of them
        says what its KV held."""
        owned = self.owners[request_id]
        for i, index in enumerate(indexes or [0]):  # none left to stop: the gateway still hears that it ended
            block_seconds = kv_block_seconds(owned) if ended and i == 0 else None
            self.emit(
                owned,
                protocol.RequestUpdate(
                    request_id, [], None, "abort", 0, index=index, kv_block_seconds=block_seconds
                ),
            )

    def release(self, request_id: str, reason: str) -> Owned:
        """Forget a request that ended, for whatever reason; a traced one's spans go out now its life is known."""
        owned = self.owners.pop(request_id)
        r = owned.choices[0]
        if reason not in NOT_RUN_HERE:
            end = max(c.finished_ns for c in owned.choices) or time.time_ns()
            self.stats.histograms["e2e_request_latency"].observe(max(0, end - r.arrival_ns) / 1e9)
        log.info(
            "request %s ended (%s): %d prompt tokens (%s), %d choices, %d output tokens, %d preemptions, "
            "%.3f KV block-seconds",
            request_id,
            reason,
            r.num_prompt_tokens,
            cached_text(r),
            len(owned.choices),
            sum(c.num_output_tokens for c in owned.choices),
            sum(c.num_preemptions for c in owned.choices),
            kv_block_seconds(owned),
            extra=log_ids(request_id, owned.trace_id),
        )
        if owned.parent is not None:
            try:
                record_request_spans(r, owned.parent, self.executor_id, reason)
            except Exception:  # a tracing fault must not cost a request its answer
                log.exception(
                    "recording the spans of request %s failed",
                    request_id,
                    extra=log_ids(request_id, owned.trace_id),
                )
        return owned

    def _count_tokens(self, owned: Owned, out: StepOutput) -> None:
        """vLLM's engine-side counts: prompt tokens and time to first token when the request's first token
        comes (its choices share one prompt), every generated token as it comes."""
        self.stats.counters["generation_tokens"] += len(out.new_token_ids)
        r = owned.choices[0]
        if owned.prefilled or not out.new_token_ids or not r.first_token_ns:
            return
        owned.prefilled = True
        self.stats.counters["prompt_tokens"] += r.num_prompt_tokens
        self.stats.histograms["time_to_first_token"].observe(max(0, r.first_token_ns - r.arrival_ns) / 1e9)


def log_ids(request_id: str | None, trace_id: str | None) -> dict[str, str | None]:
    """`extra` for a log line about one request (shared.logs puts the ids in their own fields)."""
    return {"request_id": request_id, "trace_id": trace_id}


def cached_text(r: Request) -> str:
    """Its cached prompt tokens and, when there are any, where they came from: "96 cached: 64 pool, 32 disk"."""
    if r.num_cached_tokens <= 0:
        return "0 cached"
    split = by_source(r.num_cached_tokens, r.cached_from)
    return f"{r.num_cached_tokens} cached: " + ", ".join(f"{n} {source}" for source, n in split.items() if n)


def kv_block_seconds(owned: Owned) -> float:
    """What a request's KV held, all its choices together (a group's shared prompt blocks counted once)."""
    return sum(choice.kv_block_seconds for choice in owned.choices)


def _wire_logprobs(lp: TokenLogprobs | None) -> list | None:
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, lp.rank, [[t, p] for t, p in lp.top]]
