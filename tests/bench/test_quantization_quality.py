"""bench/quantization_quality.py's factual scoring: which replies count as answering a question, and the sets it
reads (a development set and a held-out one, no question in both)."""

from __future__ import annotations

import pytest

from bench.quantization_quality import FACTUAL_SETS, README_EXAMPLE, FactualQuestion, load_factual


def test_an_answer_counts_as_a_whole_word_in_any_case() -> None:
    lion = FactualQuestion("Which animal is known as the king of the jungle?", ("lion",))
    assert lion.answered_by("The Lion is known as the king of the jungle.")
    assert not lion.answered_by("Over a million animals live in the jungle.")
    hours = FactualQuestion("How many hours are in a day?", ("24", "twenty-four"))
    assert hours.answered_by("There are 24 hours in a day.")
    assert hours.answered_by("Twenty-four.")
    assert not hours.answered_by("About 240 minutes.")
    city = FactualQuestion("What is the capital of Mexico?", ("Mexico City",))
    assert city.answered_by("It is Mexico City.") and not city.answered_by("Mexico.")


def test_the_readme_example_wants_paris() -> None:
    assert README_EXAMPLE.answered_by("The capital of France is Paris.")
    assert not README_EXAMPLE.answered_by("L'Étoile, la Marseillaise, la femme, la femme")


def test_the_sets_are_disjoint_and_the_held_out_one_has_forty_questions_or_more() -> None:
    dev, held = (load_factual(FACTUAL_SETS[name]) for name in ("dev", "heldout"))
    assert len(held) >= 40 and len(dev) >= 20
    assert not {q.question for q in dev} & {q.question for q in held}


def test_a_line_without_answers_is_named(tmp_path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"question": "Q?", "answers": ["A"]}\n\n{"question": "R?", "answers": []}\n')
    with pytest.raises(ValueError, match=r"set.jsonl:3: needs a question and a non-empty list of answers"):
        load_factual(path)
