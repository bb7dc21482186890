from __future__ import annotations

import pytest

from gateway.openai.output_text import OutputText
from tests.work_counting import Work, assert_linear, count_work

MULTIBYTE = "Emoji 😀🎉🇯🇵 and CJK 日本語の文章, 中文 — héllo wörld ✓"


def feed_one_by_one(output: OutputText, ids: list[int]) -> list[str]:
    return [output.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_multibyte_characters_split_across_tokens_are_never_broken_or_dropped(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the text really splits characters
    deltas = feed_one_by_one(OutputText(tokenizer, []), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_after_a_prompt(tokenizer):
    prompt = tokenizer.encode("Say it: ")
    ids = tokenizer.encode("日本語 😀")
    output = OutputText(tokenizer, prompt)
    deltas = feed_one_by_one(output, ids)
    assert "".join(deltas) == output.text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def straddling_stop(tokenizer, text: str) -> tuple[list[int], int, str]:
    """Token ids of text, index i of a token, and a stop string made of token i-1's tail and token i's head."""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    i = next(i for i in range(2, len(ids)) if len(pieces[i - 1]) >= 3 and len(pieces[i]) >= 3)
    return ids, i, pieces[i - 1][-2:] + pieces[i][:2]


def test_stop_string_straddling_tokens_is_trimmed_and_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids, i, stop = straddling_stop(tokenizer, text)
    output = OutputText(tokenizer, [], [stop])
    deltas = []
    for j, token_id in enumerate(ids):
        deltas.append(output.add([token_id]))
        assert output.stopped == (j >= i)  # matched exactly when the token completing it arrived
    expected = text[: text.index(stop)]
    assert "".join(deltas) == output.text == expected
    assert output.stop_reason == stop
    assert output.num_tokens == i + 1  # tokens the executor made after the match are not counted
    # before the match, the stop string's first characters were held back, not streamed
    assert "".join(deltas[:i]) == expected


def test_stop_inside_one_token_cuts_mid_token(tokenizer):
    output = OutputText(tokenizer, [], ["row"])
    deltas = feed_one_by_one(output, tokenizer.encode("a brown cow"))
    assert "".join(deltas) == output.text == "a b"
    assert output.stopped


def test_earliest_stop_string_wins(tokenizer):
    output = OutputText(tokenizer, [], ["lazy", "fox"])
    output.add(tokenizer.encode("the fox and the lazy dog"))
    assert (output.text, output.stop_reason) == ("the ", "fox")


def test_held_back_text_is_released_when_no_stop_follows(tokenizer):
    text = "I like jam and jelly"
    output = OutputText(tokenizer, [], ["jelly bean"])
    ids = tokenizer.encode(text)
    deltas = [output.add([t]) for t in ids]
    assert "".join(deltas) == text[: text.index("jelly")]  # could still become the stop string
    assert output.add([], finished=True) == "jelly"  # the output ended: nothing can complete it
    assert output.text == text and not output.stopped


def test_false_start_is_released_as_soon_as_it_diverges(tokenizer):
    output = OutputText(tokenizer, [], ["jam!"])
    deltas = [output.add([t]) for t in tokenizer.encode("jam and more")]
    assert "".join(deltas) == "jam and more"
    assert deltas[0] == ""  # "jam" was held while it could have been "jam!"


@pytest.mark.parametrize("stop", ["😀", "語"])
def test_multibyte_stop_string(tokenizer, stop):
    output = OutputText(tokenizer, [], [stop])
    deltas = feed_one_by_one(output, tokenizer.encode(MULTIBYTE))
    assert "".join(deltas) == MULTIBYTE[: MULTIBYTE.index(stop)]
    assert not any("\ufffd" in d for d in deltas)


def test_nothing_after_the_stop(tokenizer):
    output = OutputText(tokenizer, [], ["cat"])
    output.add(tokenizer.encode("a cat sat"))
    assert output.add(tokenizer.encode(" more"), finished=True) == ""
    assert output.text == "a "


def test_a_run_of_tokens_in_one_update_stops_where_one_by_one_would(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids, i, stop = straddling_stop(tokenizer, text)
    output = OutputText(tokenizer, [], [stop])
    output.add(ids)  # speculative decoding delivers several tokens in one update
    assert (output.text, output.stop_reason) == (text[: text.index(stop)], stop)
    assert output.num_tokens == i + 1  # the tokens after the one completing it are not counted


def test_the_stop_string_completed_first_wins_however_the_tokens_arrive(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps")
    one_update = OutputText(tokenizer, [], ["fox", "quick brown fox jumps"])
    one_update.add(ids)
    one_by_one = OutputText(tokenizer, [], ["fox", "quick brown fox jumps"])
    feed_one_by_one(one_by_one, ids)
    assert (one_update.text, one_update.stop_reason) == ("the quick brown ", "fox")
    assert (one_by_one.text, one_by_one.stop_reason) == ("the quick brown ", "fox")


@pytest.mark.parametrize("stop", [[], ["never said", "The quick brown fox jumps over the lazy cat"]])
def test_a_tokens_work_does_not_grow_with_the_text_before_it(tokenizer, stop):
    """Streaming twice the tokens costs twice the work: no copy of the text so far, no scan of it, per token."""
    sentence = tokenizer.encode(" The quick brown fox jumps over the lazy dog, 日本語 😀.")
    files = ("gateway/openai/output_text.py", "shared/stop_strings.py", "shared/detokenize.py")

    def work(repeats: int) -> Work:
        output = OutputText(tokenizer, [], stop)
        ids = sentence * repeats
        work = count_work(lambda token_id: output.add([token_id]), ids, files)
        assert output.add([], finished=True) == ""  # nothing held back: no stop string starts with "."
        assert output.text == tokenizer.decode(ids) and not output.stopped
        return work

    assert_linear(work(50), work(100))
