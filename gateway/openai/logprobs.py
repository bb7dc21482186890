"""Token logprobs in OpenAI's two formats: chat's `content` list and the legacy completions columns."""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing precedes
    top: list[tuple[int, float]] | None  # (token id, logprob), best first
    rank: int | None = None  # of token_id in its distribution, 1 = most likely

    def cut(self, num_top: int) -> TokenLogprob:
        """The same entry with its best num_top only: the executor computes one list for several uses."""
        return TokenLogprob(
            self.token_id, self.logprob, None if self.top is None else self.top[:num_top], self.rank
        )


def token_logprob(entry) -> TokenLogprob:
    """From the wire's `[token_id, logprob, rank, [[id, logprob], ...]]` (shared.protocol) or an object with
    those attributes (executor.sampling.sampler.TokenLogprobs), so the gateway reads either without caring
    which."""
    if isinstance(entry, (list, tuple)):
        token_id, logprob, rank, top = entry
    else:
        token_id, logprob, rank, top = entry.token_id, entry.logprob, entry.rank, entry.top
    return TokenLogprob(token_id, logprob, [(t, lp) for t, lp in top], rank)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character; this is the inverse of GPT-2's table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


@functools.cache
def logprob_formatter(tokenizer) -> LogprobFormatter:
    """One per tokenizer, so every request shares what it has learnt of the vocabulary."""
    return LogprobFormatter(tokenizer)


class LogprobFormatter:
    """Knows the tokenizer's byte scheme, since OpenAI reports each token's exact bytes, even half a character.
    Each token's bytes and text are worked out once (the vocabulary bounds them): n choices x top_logprobs entries
    a token would otherwise ask the tokenizer twice each, on the gateway's event loop."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._bytes: dict[int, bytes] = {}
        self._texts: dict[int, str] = {}

    def token_bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._piece_bytes(token_id)
        return found

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level and all(ch in _BYTE_DECODER for ch in piece):
            return bytes(_BYTE_DECODER[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """A token that is not whole UTF-8 is written as OpenAI does: `bytes:\\xe6\\x97`."""
        found = self._texts.get(token_id)
        if found is None:
            found = self._texts[token_id] = self._piece_text(token_id)
        return found

    def _piece_text(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {
            "token": self.token_text(token_id),
            "logprob": logprob,
            "bytes": list(self.token_bytes(token_id)),
        }

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        """Chat's `choices[].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = [
            {**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content}

    def completion(self, entries: Sequence[TokenLogprob], text_offset: int) -> dict:
        """Completions' columns; text_offset is where the first entry's text starts in the output."""
        tokens, offsets, done = [], [], 0
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        for e in entries:
            tokens.append(self.token_text(e.token_id))
            # characters completed before this token: a token holding half a character does not move it
            offsets.append(text_offset + done)
            done += len(decoder.decode(self.token_bytes(e.token_id)))
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if e.top is None else {self.token_text(t): lp for t, lp in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, entries: Sequence[TokenLogprob], num_top: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob, rank,
        decoded_token}} holding the token itself and its position's best num_top."""
        listed: list[dict | None] = [None]
        for e in entries[1:]:
            position = {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)}
                for rank, (t, lp) in enumerate(e.top[:num_top], start=1)
            }
            position[str(e.token_id)] = {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": self.token_text(e.token_id),
            }
            listed.append(position)
        return listed
