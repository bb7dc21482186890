"""Stop strings are matched on text, not tokens: a match may straddle tokens, and the output ends before it."""

from __future__ import annotations

from collections.abc import Sequence

from shared.detokenize import IncrementalDetokenizer
from shared.growing_text import GrowingText


def find_stop(text: str, num_new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that the last num_new_chars characters completed: (its index in text, it)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        # only a match that ends inside the new text is new; start looking just early enough to find it
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class CompletionText:
    """A completion's text as its tokens arrive: decoded incrementally and ended before its first stop string.
    With stop strings, a run of tokens (speculative decoding brings several a step) goes in one at a time, so
    the match is the one the earliest token completes, wherever the steps split the run.

    A token costs what its own text and the stop strings' lengths cost, never the text before it: the text
    grows in pieces, and stop strings are looked for in its last characters only."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stops: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = list(stops)
        # a stop string completed by new text starts at most this many characters before it
        self._reach = max(map(len, self._stops), default=1) - 1
        self._text = GrowingText()
        self._recent = ""  # text's last _reach characters
        self.stop_reason: str | None = None  # the stop string matched
        self.num_tokens = 0  # completion tokens up to (and including) the one that completed a stop string

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """The decoded text so far, without the stop string and anything after it."""
        return self._text.value()

    def text_from(self, start: int) -> str:
        """text[start:], at the cost of its own length."""
        return self._text.since(start)

    def add(self, token_ids: Sequence[int], finished: bool = False) -> int:
        """Feed new tokens (finished: the last ones); how many of them count, all but those after a stop
        string's match (none once stopped)."""
        if self.stopped:
            return 0
        pieces = [[t] for t in token_ids] if self._stops and len(token_ids) > 1 else [token_ids]
        kept = 0
        for i, piece in enumerate(pieces):
            new = self._detok.add(piece)
            kept += len(piece)
            if finished and i == len(pieces) - 1:
                new += self._detok.flush()
            if new and self._append(new):
                break
        self.num_tokens += kept
        return kept

    def _append(self, new: str) -> bool:
        """Add new text; whether it completed a stop string (the text then ends before the match)."""
        self._text.append(new)
        if not self._stops:
            return False
        recent = self._recent + new
        hit = find_stop(recent, len(new), self._stops)
        if hit is None:
            self._recent = recent[-self._reach :] if self._reach else ""
            return False
        index, self.stop_reason = hit
        self._text.cut(len(self._text) - len(recent) + index)
        return True
