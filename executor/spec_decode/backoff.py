"""When speculation is worth it: the rule that keeps it from costing throughput.

1. Batch size: no request proposes while more than `max_batch` requests are running (the flag
   --speculative-disable-by-batch-size, vLLM's name). A big batch already keeps the hardware busy, so every
   rejected proposal it verifies costs real compute, and on the CPU each verified run goes through the slower
   multi-token attention path.
2. Acceptance: each request keeps a moving average of the share of its proposals the target accepted (new
   verifications weigh EMA_WEIGHT). When it falls below MIN_ACCEPTANCE the request stops proposing for a pause
   of PAUSE_STEPS of its steps, doubled each time it falls again (at most MAX_PAUSE_STEPS), then tries again
   from a neutral average; a request whose proposals do well again starts over from the shortest pause.

MIN_ACCEPTANCE is low on purpose. Below the batch limit a step is bound by reading the weights, so verifying
k = 4 more tokens costs about 15% more per step (CPU, default model; less on a GPU), and a request pays for its
proposals only when fewer than about 4% are accepted. Pausing sooner costs more than it saves: a pause also
skips the runs of good proposals that follow a few bad ones.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE = 0.1
EMA_WEIGHT = 0.3
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 128


@dataclass(slots=True)
class _Acceptance:
    average: float = 1.0  # optimistic start: a request gets to show what its proposals are worth
    pause: int = PAUSE_STEPS  # the next pause's length
    paused_for: int = 0  # steps left in the current pause


class SpecBackoff:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._requests: dict[str, _Acceptance] = {}

    def batch_allows(self, num_running: int) -> bool:
        return num_running <= self.max_batch

    def request_allows(self, request_id: str) -> bool:
        """Whether this request proposes this step; counts down its pause."""
        state = self._requests.get(request_id)
        if state is None or state.paused_for == 0:
            return True
        state.paused_for -= 1
        if state.paused_for == 0:
            state.average = 2 * MIN_ACCEPTANCE  # neutral: two bad verifications in a row pause it again
        return False

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        state = self._requests.setdefault(request_id, _Acceptance())
        state.average += EMA_WEIGHT * (num_accepted / num_proposed - state.average)
        if state.average < MIN_ACCEPTANCE:
            state.paused_for = state.pause
            state.pause = min(2 * state.pause, MAX_PAUSE_STEPS)
        elif state.average >= 2 * MIN_ACCEPTANCE and state.pause > PAUSE_STEPS:
            state.pause = PAUSE_STEPS

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
