"""Synthetic prompts for `kvserve bench`: groups of requests that share a long prefix, each with its own question.

Without a tokenizer, lengths are counted in words: the text is made of common lowercase English words, each one
token (with its leading space) in GPT-2-style BPE vocabularies such as SmolLM2's and Llama's, so a P-word prefix
is about P tokens. With a tokenizer, each word is weighed by the tokens it actually takes, so lengths are exact
up to merges at the ends. The prefix ends in ".\n" and the question starts with a letter: byte-level BPE
pre-tokenizers (GPT-2's, Llama 3's) never merge across that boundary, so the prefix tokenizes the same whatever
question follows, which is what lets a prefix cache reuse it. (A blank line would not do: "\n\n" before a letter
splits into "\n", "\n".)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their has been if more when will would who so no time year people "
    "way day man thing woman life child world school state family student group country problem hand part "
    "place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city name president team minute idea kid "
    "body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education"
)
WORDS = tuple(_COMMON_WORDS.split())

QUESTION_STARTS = ("What", "Why", "How", "When", "Where", "Which")

# Token count of " word" (the word as it appears mid-text); the default treats every word as one token.
TokenCounter = Callable[[str], int]


@dataclass(slots=True)
class Prompt:
    text: str
    group: int | None  # which shared prefix it starts with; None for a fixed --prompt


def _words(rng: random.Random, tokens: int, count_tokens: TokenCounter) -> list[str]:
    """Random words adding up to about `tokens` tokens (never over, unless one word alone is)."""
    words: list[str] = []
    total = 0
    while total < tokens:
        word = rng.choice(WORDS)
        cost = count_tokens(word)
        if words and total + cost > tokens:
            break
        words.append(word)
        total += cost
    return words


def one_token_per_word(word: str) -> int:
    return 1


def tokenizer_counter(tokenizer_dir: str) -> TokenCounter:
    """Counts tokens with the model's own tokenizer (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cache: dict[str, int] = {}

    def count(word: str) -> int:
        if word not in cache:
            cache[word] = len(tokenizer.encode(" " + word, add_special_tokens=False))
        return cache[word]

    return count


def shared_prefixes(groups: int, prefix_tokens: int, seed: int, count_tokens: TokenCounter) -> list[str]:
    """One prefix per group; each group's text is drawn from its own random stream, so groups differ."""
    prefixes = []
    for group in range(groups):
        rng = random.Random(f"{seed}:prefix:{group}")
        words = _words(rng, prefix_tokens, count_tokens)
        prefixes.append(" ".join(words).capitalize() + ".\n" if words else "")
    return prefixes


class PrefixWorkload:
    """Request i gets group i mod G's prefix and a question that no other request has (it carries i).

    Prompts are made on demand from (seed, i), so a run bounded only by --duration needs no count up front."""

    def __init__(
        self,
        groups: int,
        prefix_tokens: int,
        question_tokens: int,
        seed: int = 0,
        count_tokens: TokenCounter = one_token_per_word,
    ) -> None:
        if groups < 1:
            raise ValueError("--prefix-groups must be at least 1")
        self.prefixes = shared_prefixes(groups, prefix_tokens, seed, count_tokens)
        self.question_tokens = question_tokens
        self.seed = seed
        self.count_tokens = count_tokens

    def prompt(self, i: int) -> Prompt:
        group = i % len(self.prefixes)
        rng = random.Random(f"{self.seed}:question:{i}")
        # "Question 17: What" takes about four tokens of the budget; random words fill the rest
        words = _words(rng, max(1, self.question_tokens - 4), self.count_tokens)
        question = f"Question {i}: {rng.choice(QUESTION_STARTS)} {' '.join(words)}?"
        return Prompt(self.prefixes[group] + question, group)


@dataclass(slots=True)
class FixedPrompt:
    """The same text for every request (--prompt)."""

    text: str

    def prompt(self, i: int) -> Prompt:
        return Prompt(self.text, None)
