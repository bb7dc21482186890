"""Incremental detokenization: text grows token by token without ever emitting half a character."""

from __future__ import annotations

from collections.abc import Sequence

# prompt tokens decoded along with the output, so the first output token gets its leading space right
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes a window of tokens, [context, new), and emits what the new ones added; a trailing U+FFFD means a
    token ended inside a multi-byte character (byte fallback / byte-level BPE), so it waits for the next one.
    It keeps only the window, and no text: what a token costs does not grow with the text before it."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # the window
        self.read_offset = len(self.token_ids)  # where its tokens not yet emitted start

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they completed (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[: self.read_offset])
        full_text = self._decode(self.token_ids)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        self._advance()
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a sequence, whatever was held back (even a broken character) is emitted."""
        prefix_text = self._decode(self.token_ids[: self.read_offset])
        full_text = self._decode(self.token_ids)
        self.token_ids.clear()
        self.read_offset = 0
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _advance(self) -> None:
        """The tokens just emitted become the next window's context; the ones before them are dropped."""
        del self.token_ids[: self.read_offset]
        self.read_offset = len(self.token_ids)
