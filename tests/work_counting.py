"""The work a stream of pieces costs, counted instead of timed, so tests can assert it grows linearly without
flaking on a busy machine: lines of Python run in the code under test, and memory each piece touched."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Work:
    lines: int  # lines of Python run inside the files watched
    memory: int  # bytes: for each piece, its peak allocation over what was allocated before it, summed


def count_work(feed: Callable[[object], object], pieces: Iterable[object], files: tuple[str, ...]) -> Work:
    """feed(piece) for each piece. Code that re-reads or copies all it has seen at each piece shows as a square
    law in one of the two: a rescan in lines, a copy of the text so far (str concatenation, slicing) in memory."""
    work = Work(0, 0)

    def trace_lines(frame, event, arg):
        if event == "line":
            work.lines += 1
        return trace_lines

    def trace_calls(frame, event, arg):
        return trace_lines if frame.f_code.co_filename.endswith(files) else None

    previous = sys.gettrace()
    tracemalloc.start()
    sys.settrace(trace_calls)
    try:
        for piece in pieces:
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            feed(piece)
            work.memory += tracemalloc.get_traced_memory()[1] - before
    finally:
        sys.settrace(previous)
        tracemalloc.stop()
    return work


def assert_linear(small: Work, large: Work) -> None:
    """large fed twice what small did: linear work is about twice as much, a square law four times."""
    assert large.lines < 2.5 * small.lines, (small, large)
    assert large.memory < 2.5 * small.memory, (small, large)
