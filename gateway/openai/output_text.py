"""Generated tokens become the text a user sees: decoded incrementally, cut at a stop string, never ahead of it."""

from __future__ import annotations

from collections.abc import Sequence

from shared.growing_text import GrowingText
from shared.stop_strings import CompletionText


class OutputText:
    """Releases text only once it can no longer turn out to be part of a stop string, so a streamed delta is
    never taken back; OpenAI's output excludes the stop string itself. What an update costs depends on its own
    text and the stop strings, never on the text released before it."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._completion = CompletionText(tokenizer, prompt_token_ids, stop)
        self._stops = list(stop)
        self._released = GrowingText()

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._released.value()

    @property
    def num_chars(self) -> int:
        """Of the text released so far."""
        return len(self._released)

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
        # what is not released yet: at most a stop string's length of held-back text and the new text
        unreleased = self._completion.text_from(self.num_chars)
        if not (finished or self.stopped):
            unreleased = unreleased[: len(unreleased) - self._held_back(unreleased)]
        self._released.append(unreleased)
        return unreleased

    def _held_back(self, unreleased: str) -> int:
        """Length of the longest end of the unreleased text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(unreleased)), longest, -1):
                if unreleased.endswith(stop[:k]):
                    longest = k
                    break
        return longest
