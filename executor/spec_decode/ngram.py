"""Prompt lookup: the tokens that followed the last earlier occurrence of the sequence's longest recent n-gram."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens; none when no n-gram of min_n..max_n tokens ending the sequence occurred before.

        Among the earlier occurrences of the last token, each is scored by how many tokens before it also
        match the sequence's tail (up to max_n); the longest match wins, the most recent among equals.
        Vectorised over the whole sequence: a few numpy passes, no Python loop over positions.
        """
        n = len(token_ids)
        if k < 1 or n < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        # candidate ends: positions before the last token holding the same token as the last
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            prev = ends - back
            ok = alive & (prev >= 0)
            ok[ok] = tokens[prev[ok]] == tokens[n - 1 - back]
            if not ok.any():
                break
            matched += ok
            alive = ok
        best = matched.max()
        if best < self.min_n:
            return []
        end = ends[np.flatnonzero(matched == best)[-1]]
        return tokens[end + 1 : end + 1 + k].tolist()
