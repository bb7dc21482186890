"""Generated tokens become the text a user sees: decoded incrementally, cut at a stop string, never ahead of it."""

from __future__ import annotations

from collections.abc import Sequence

from shared.stop_strings import CompletionText


class OutputText:
    """Releases text only once it can no longer turn out to be part of a stop string, so a streamed delta is
    never taken back; OpenAI's output excludes the stop string itself."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._completion = CompletionText(tokenizer, prompt_token_ids, stop)
        self._stops = list(stop)
        self.text = ""  # released so far

    @property
    def num_tokens(self) -> int:
        """Completion tokens up to (and including) the one that completed a stop string."""
        return self._completion.num_tokens

    @property
    def stop_reason(self) -> str | None:
        """The stop string matched."""
        return self._completion.stop_reason

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the caller should abort the executor request."""
        return self._completion.stopped

    def add(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """Feed new tokens (finished: the last ones); return the text they released, possibly empty."""
        if self.stopped:  # tokens the executor made before our abort reached it are not output
            return ""
        self._completion.add(token_ids, finished)
        full = self._completion.text
        if finished or self.stopped:
            return self._release(full)
        return self._release(full[: len(full) - self._held_back(full)])

    def _held_back(self, full: str) -> int:
        """Length of the longest unreleased tail that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(full) - len(self.text)), longest, -1):
                if full.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: str) -> str:
        new = upto[len(self.text) :]
        self.text += new
        return new
