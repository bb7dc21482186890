"""Generated tokens become the text a user sees: decoded incrementally, cut at a stop string, never ahead of it."""

from __future__ import annotations

from collections.abc import Sequence

from shared.detokenize import IncrementalDetokenizer
from shared.stop_strings import find_stop


class OutputText:
    """Releases text only once it can no longer turn out to be part of a stop string, so a streamed delta is
    never taken back; OpenAI's output excludes the stop string itself."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = list(stop)
        self.text = ""  # released so far
        self.num_tokens = 0  # completion tokens up to (and including) the one that completed a stop string
        self.stop_reason: str | None = None  # the stop string matched

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the caller should abort the executor request."""
        return self.stop_reason is not None

    def add(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """Feed new tokens (finished: the last ones); return the text they released, possibly empty."""
        if self.stopped:  # tokens the executor made before our abort reached it are not output
            return ""
        self.num_tokens += len(token_ids)
        new = self._detok.add(token_ids)
        if finished:
            new += self._detok.flush()
        full = self._detok.text
        if self._stops and new:
            hit = find_stop(full, len(new), self._stops)
            if hit is not None:
                self.stop_reason = hit[1]
                return self._release(hit[0])
        return self._release(len(full) if finished else len(full) - self._held_back(full))

    def _held_back(self, full: str) -> int:
        """Length of the longest unreleased tail that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(full) - len(self.text)), longest, -1):
                if full.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, end: int) -> str:
        new = self._detok.text[len(self.text) : end] if end > len(self.text) else ""
        self.text += new
        return new
