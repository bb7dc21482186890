"""Deterministic prompts for the offline benchmarks: real text cut to chosen token lengths."""

from __future__ import annotations

import random

_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "then came stored programs, assemblers, compilers, operating systems and virtual memory, each hiding the "
    "layer below so that people could think about larger problems. A language model served to many users at "
    "once spends most of its memory on the keys and values of the tokens it has already seen. Paging that "
    "memory in small fixed blocks, sharing the blocks of common prefixes and scheduling work under one token "
    "budget per step are the ideas that let one machine answer many people without stalling any of them. "
)


def token_pool(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    chunk = tokenizer.encode(_TEXT)
    while len(ids) < n:
        ids.extend(chunk)
    return ids[:n]


def spread_prompts(tokenizer, count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """count prompts with lengths spread evenly over [lo, hi], each starting at a different offset."""
    rng = random.Random(seed)
    pool = token_pool(tokenizer, hi * 4)
    lengths = [lo + (hi - lo) * i // max(1, count - 1) for i in range(count)]
    rng.shuffle(lengths)
    prompts = []
    for length in lengths:
        start = rng.randrange(0, len(pool) - length)
        prompts.append(pool[start : start + length])
    return prompts
