"""Stop strings are matched on text, not tokens: a match may straddle tokens, and the output ends before it."""

from __future__ import annotations

from collections.abc import Sequence


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
