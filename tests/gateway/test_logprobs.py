from __future__ import annotations

from gateway.openai.logprobs import LogprobFormatter


def test_byte_level_tokens_report_their_exact_bytes(tokenizer):
    formatter = LogprobFormatter(tokenizer)
    text = "😀 日本語 héllo<|im_end|>"
    ids = tokenizer.encode(text)
    assert b"".join(formatter.token_bytes(t) for t in ids) == text.encode()
    partial = [formatter.token_text(t) for t in ids if formatter.token_text(t).startswith("bytes:")]
    assert partial and partial[0] == "bytes:\\xf0\\x9f"  # half an emoji, written as OpenAI writes it
    assert formatter.token_text(tokenizer.encode(" héllo")[-2]) == "é"


class SentencePieceLike:
    """A byte-fallback vocabulary: `<0xE6>` pieces and `▁` for spaces."""

    pieces = {0: "<0xE6>", 1: "<0x97>", 2: "<0xA5>", 3: "\u2581hi"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_byte_fallback_tokens_report_their_bytes():
    formatter = LogprobFormatter(SentencePieceLike())
    assert b"".join(formatter.token_bytes(t) for t in (0, 1, 2)).decode() == "日"
    assert formatter.token_text(0) == "bytes:\\xe6"
    assert formatter.token_text(3) == " hi"


def test_text_offsets_count_whole_characters_only(tokenizer):
    """A character split over two tokens moves the offset once, after its last byte; same as decoding the whole."""
    from gateway.openai.logprobs import LogprobFormatter, TokenLogprob

    formatter = LogprobFormatter(tokenizer)
    ids = tokenizer.encode("Ünïcödé 日本語 text, then more: 🎉 done")
    entries = [TokenLogprob(t, -1.0, []) for t in ids]
    offsets = formatter.completion(entries, 5)["text_offset"]
    seen, expected = b"", []
    for t in ids:
        expected.append(5 + len(seen.decode(errors="ignore")))
        seen += formatter.token_bytes(t)
    assert offsets == expected and offsets[-1] > offsets[0]
