"""Constrained decoding's per-step side: each structured request's matcher, and the token bitmask it fills.

Rows without a grammar cost nothing: no mask exists when no row of the batch is constrained. The matcher advances
only with emitted tokens, which survive preemption, so recompute needs nothing from here. Speculation: each
verified position gets the mask of the state after the proposals before it (the matcher rolled back afterwards),
so a proposal the grammar refuses is always rejected; one-hot proposals (n-gram, greedy draft) are also cut there
before the step, which saves their verification.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

try:
    import xgrammar as xgr
except (
    ImportError
):  # an executor serves without it; no request gets a grammar then (executor/structured/grammars.py)
    xgr = None


class RequestGrammar:
    """One request's matcher, built when its grammar is ready; it has accepted exactly the emitted tokens."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled: the request may be scheduled."""
        return self.future.done() and self.error is None

    @property
    def error(self) -> BaseException | None:
        """Why it never will be: the compile's exception (a ValueError is the spec's fault), or None."""
        if not self.future.done():
            return None
        if self.future.cancelled():  # only when the grammars closed under it
            return RuntimeError("structured outputs: the grammar's compile was cancelled")
        return self.future.exception()

    def _matcher(self) -> xgr.GrammarMatcher:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.future.result())  # rollback is unbounded in xgrammar 0.2
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advance with an emitted token; True when the grammar is complete (the request finishes: "stop")."""
        matcher = self._matcher()
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its own mask allowed")
        return matcher.is_terminated()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading proposals the grammar allows (the matcher is left as it was)."""
        matcher, n = self._matcher(), 0
        while n < len(token_ids) and not matcher.is_terminated() and matcher.accept_token(token_ids[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, proposals: list[int]) -> None:
        """Rows row .. row + len(proposals): the masks after the emitted tokens and each prefix of proposals.

        A proposal the grammar refuses has probability 0 under its mask, so verification always rejects it:
        the rows past it are never sampled from and stay unmasked."""
        matcher, accepted = self._matcher(), 0
        matcher.fill_next_token_bitmask(bitmask, row)
        for token_id in proposals:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
            matcher.fill_next_token_bitmask(bitmask, row + accepted)
        if accepted:
            matcher.rollback(accepted)


class TokenBitmask:
    """The step's allowed tokens: bit t of a row's words set when token t may come next; rows of requests
    without a grammar are left out of `rows`, so applying it touches only constrained rows."""

    __slots__ = ("bitmask", "rows", "vocab_size")

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place, for every constrained row at once."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


def step_bitmask(
    grammars: list[RequestGrammar | None], proposals: list[list[int]], vocab_size: int
) -> TokenBitmask | None:
    """The mask for one step's logits (each request's len(proposals) + 1 rows after one another); None when
    no request of the step is constrained."""
    if all(g is None for g in grammars):
        return None
    num_rows = sum(len(p) + 1 for p in proposals)
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    rows, row = [], 0
    for grammar, drafted in zip(grammars, proposals, strict=True):
        if grammar is not None:
            grammar.fill(bitmask, row, drafted)
            rows.extend(range(row, row + len(drafted) + 1))
        row += len(drafted) + 1
    return TokenBitmask(bitmask, rows, vocab_size)
