"""Text that grows a piece at a time and is read whole only now and then, such as a streamed completion."""

from __future__ import annotations


class GrowingText:
    """Python strings do not grow in place: `text += piece` copies the whole text, which over a stream of pieces
    is a square law. The pieces are kept instead, and joined when the whole text is asked for."""

    __slots__ = ("_pieces", "_length")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)

    def value(self) -> str:
        """The whole text (kept joined, so asking twice joins once)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def since(self, start: int) -> str:
        """text[start:], in time proportional to its length rather than the whole text's."""
        taken: list[str] = []
        size = self._length
        for piece in reversed(self._pieces):
            if size <= start:
                break
            taken.append(piece if size - len(piece) >= start else piece[start - size :])
            size -= len(piece)
        return "".join(reversed(taken))

    def cut(self, end: int) -> None:
        """Keep text[:end] only."""
        if end < self._length:
            self._pieces = [self.value()[:end]] if end > 0 else []
            self._length = max(end, 0)
