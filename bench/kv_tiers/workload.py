"""What the KV tiers benchmark sends, how many bytes of KV that makes, and its one table.

Sizes come from the model's config.json, never hard-coded: a token's KV is layers x 2 (K and V) x KV heads x
head dim x the dtype's bytes (SmolLM2-135M in float32: 30 x 2 x 3 x 64 x 4 = 46,080 B). Texts are
bench/prompts.py's common words, about one token each, drawn per user and turn so that no two share a prefix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from bench.prompts import one_token_per_word, shared_prefixes
from shared.model_paths import pulled_model_dir

KV_DTYPE_BYTES = 4  # the stacks run float32 (bench/tenancy/tenant_stack.py)
# what a conversation's prompt holds besides the documents, messages and answers, as SmolLM2's chat template
# makes it: the instructions, the first question and the role markers; then each later turn's question line and
# role markers. An estimate that sizes the pool: the report has the measured working set beside it.
FIRST_TURN_TOKENS = 55
TURN_TOKENS = 25
FIRST_QUESTION = "Question: what are the three main points of this document, and why do they matter?"
HOST_TIER_HEADROOM = (
    1.5  # the host tier holds the working set with room to spare: what it lacks is not measured
)
MIN_POOL_REQUESTS = 2  # a pool smaller than two whole conversations would measure refusals, not caching


def model_config(model: str | None) -> dict:
    """The served model's config.json (pulled first when it is the default and not there yet)."""
    return json.loads((pulled_model_dir(model) / "config.json").read_text())


def kv_bytes_per_token(config: dict, dtype_bytes: int = KV_DTYPE_BYTES) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class ConversationShape:
    users: int
    turns: int
    document_tokens: int
    message_tokens: int
    max_output_tokens: int

    def history_tokens(self) -> int:
        """One conversation's last prompt and answer: the KV its user's next visit would reuse."""
        later = (self.turns - 1) * (self.message_tokens + TURN_TOKENS)
        return FIRST_TURN_TOKENS + self.document_tokens + later + self.turns * self.max_output_tokens


@dataclass(frozen=True, slots=True)
class TierSizes:
    working_set: int  # bytes of KV every conversation's history holds at its end
    pool: int  # --kv-cache-memory
    host: int  # --kv-offload-memory of the run with a tier
    pool_floored: bool  # the pool was raised to MIN_POOL_REQUESTS conversations (a scaled-down run)


def tier_sizes(shape: ConversationShape, bytes_per_token: int, pool_fraction: float) -> TierSizes:
    """The pool a pool_fraction of the working set (at least MIN_POOL_REQUESTS conversations), the host tier
    HOST_TIER_HEADROOM times it."""
    working_set = shape.users * shape.history_tokens() * bytes_per_token
    floor = MIN_POOL_REQUESTS * shape.history_tokens() * bytes_per_token
    pool = int(working_set * pool_fraction)
    return TierSizes(working_set, max(pool, floor), int(working_set * HOST_TIER_HEADROOM), pool < floor)


class Conversations:
    """User u's turn k: a document and a question first, then a message of its own each turn."""

    def __init__(self, shape: ConversationShape, seed: int) -> None:
        self.shape = shape
        self.documents = shared_prefixes(shape.users, shape.document_tokens, seed, one_token_per_word)
        self.messages = shared_prefixes(
            shape.users * shape.turns, shape.message_tokens, seed + 1, one_token_per_word
        )

    def input(self, user: int, turn: int) -> str:
        if turn == 0:
            return f"Here is a document.\n\n{self.documents[user]}{FIRST_QUESTION}"
        message = self.messages[user * self.shape.turns + turn]
        return f"{message}Question {turn + 1}: how does this change what you said before?"


def distinct_prompts(count: int, tokens: int, seed: int) -> list[str]:
    """Texts of about `tokens` tokens, no two sharing a first block."""
    return [
        f"{text}Question {i + 1}: what is this text about?"
        for i, text in enumerate(shared_prefixes(count, tokens, seed, one_token_per_word))
    ]


def random_token_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Token ids drawn at random above the special ones: a prefix nothing else in the run shares."""
    return [rng.randrange(256, vocab_size) for _ in range(length)]


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: the baseline (no tier, recompute, the first visit) against the tiers."""

    part: str
    measure: str
    baseline: str
    tiers: str
    ratio: str = ""
    target: str = ""
    met: bool | None = None  # None: no target on this line, or not measured


HEADER = ("part", "measure", "baseline", "KV tiers", "ratio", "target", "met")


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        met = {None: "", True: "yes", False: "**no**"}[row.met]
        cells = (row.part, row.measure, row.baseline, row.tiers, row.ratio, row.target, met)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator
