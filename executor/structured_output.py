"""Constrained decoding: each structured request's output held to its grammar by a token bitmask per step.

The grammar library is xgrammar (vLLM's and SGLang's default): measured at the default model's 49k vocabulary it
filled a mask in ~5 us a token (llguidance ~23 us, with 7 ms spikes) and compiled a typical schema in ~40 ms.
Grammars compile on a worker thread, once per (kind, spec), kept in a bounded LRU; a request waits in the queue
until its grammar is ready (scheduler.py skips it), and one whose grammar fails is refused with a ValueError's
message naming structured_outputs.<kind>. Rows without a grammar cost nothing: no mask exists when no row of the
batch is constrained. The matcher advances only with emitted tokens, which survive preemption, so recompute
needs nothing from here. Speculation: each verified position gets the mask of the state after the proposals
before it (the matcher rolled back afterwards), so a proposal the grammar refuses is always rejected; one-hot
proposals (n-gram, greedy draft) are also cut there before the step, which saves their verification.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from shared.structured_outputs import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first
# xgrammar's errors start with "[time] /project/cpp/file.cc:line: "; the client needs what follows
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _library_message(error: Exception) -> str:
    return _LOCATION.sub("", str(error).strip()).strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF rule matching exactly one of the strings (JSON escapes are EBNF's string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes a string with minLength/maxLength as a run of [^"\\\r\n]: raw tabs and other control
# characters, which JSON forbids inside strings, pass, and escapes do not. Each such character is made the one
# plain strings use, or one escape (a JSON escape is one character of the string's length).
_LOOSE_STRING_CHARACTER = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_STRING_CHARACTER = r' ::= (([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'


def json_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, as the library writes it, with its strings held to JSON's rules. No free
    whitespace: a small model given the choice can fill max_tokens with newlines."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return _LOOSE_STRING_CHARACTER.sub(lambda rule: rule.group(1) + _STRING_CHARACTER, ebnf)


class Grammars:
    """The compiled grammars of one model's tokenizer; the tokenizer info is built once, here."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._workers = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations started (cache misses)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar, or its ValueError, once ready; a spec asked before shares the first one's."""
        key = (spec.kind, json.dumps(getattr(spec, spec.kind), ensure_ascii=False))
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._workers.submit(self._compile, spec)
            self._cache[key] = future
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)  # requests still compiling it hold their own reference
        return future

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                return self._compiler.compile_grammar(json_grammar(spec.json or '{"type": "object"}'))
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"structured_outputs.{kind}: {_library_message(error)}") from None

    def start(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A request's grammar state; raises the ValueError at once when the spec is known to fail."""
        grammar = RequestGrammar(self.compile(spec))
        grammar.raise_if_failed()
        return grammar

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher, built when its grammar is ready; it has accepted exactly the emitted tokens."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled: the scheduler may take the request (a failed one waits for the engine to refuse it)."""
        return self.future.done() and self.future.exception() is None

    @property
    def error(self) -> str | None:
        if not self.future.done():
            return None
        error = self.future.exception()
        return None if error is None else str(error)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise ValueError(self.error)

    def _matcher(self) -> xgr.GrammarMatcher:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.future.result())  # rollback is unbounded in xgrammar 0.2
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advance with an emitted token; True when the grammar is complete (the request finishes: "stop")."""
        matcher = self._matcher()
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its own mask allowed")
        return matcher.is_terminated()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading proposals the grammar allows (the matcher is left as it was)."""
        matcher, n = self._matcher(), 0
        while n < len(token_ids) and not matcher.is_terminated() and matcher.accept_token(token_ids[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, proposals: list[int]) -> None:
        """Rows row .. row + len(proposals): the masks after the emitted tokens and each prefix of proposals.

        A proposal the grammar refuses has probability 0 under its mask, so verification always rejects it:
        the rows past it are never sampled from and stay unmasked."""
        matcher, accepted = self._matcher(), 0
        matcher.fill_next_token_bitmask(bitmask, row)
        for token_id in proposals:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
            matcher.fill_next_token_bitmask(bitmask, row + accepted)
        if accepted:
            matcher.rollback(accepted)


class TokenBitmask:
    """The step's allowed tokens: bit t of a row's words set when token t may come next; rows of requests
    without a grammar are left out of `rows`, so applying it touches only constrained rows."""

    __slots__ = ("bitmask", "rows", "vocab_size")

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place, for every constrained row at once."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


def step_bitmask(
    grammars: list[RequestGrammar | None], proposals: list[list[int]], vocab_size: int
) -> TokenBitmask | None:
    """The mask for one step's logits (each request's len(proposals) + 1 rows after one another); None when
    no request of the step is constrained."""
    if all(g is None for g in grammars):
        return None
    num_rows = sum(len(p) + 1 for p in proposals)
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    rows, row = [], 0
    for grammar, drafted in zip(grammars, proposals, strict=True):
        if grammar is not None:
            grammar.fill(bitmask, row, drafted)
            rows.extend(range(row, row + len(drafted) + 1))
        row += len(drafted) + 1
    return TokenBitmask(bitmask, rows, vocab_size)
