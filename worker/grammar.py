"""Constrained decoding with llguidance: grammars compiled per request, one matcher per stream,
one token bitmask per step for the whole batch.

The llguidance tokenizer is built from the same GGUF vocabulary the engine uses: every token's
raw bytes, with control tokens (and user-defined ones shaped ``<...>``, such as ``<tool_call>``)
marked special so grammars name them as tokens, and the model's end-of-turn ids as EOS.
Compilation runs on a small thread pool, off the decode path.

llguidance itself is imported with the first grammar: a worker that never constrains a reply
does not hold it (2-4 MiB of a worker's memory: its library's pages and its Python side).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from shared.errors import InvalidRequestError
from shared.protocol import Grammar, GrammarKind
from shared.tokenizer import Tokenizer
from worker import metrics

if TYPE_CHECKING:
    import llguidance as llg

# Compact JSON with at most a little whitespace: a small model left free to emit whitespace can
# loop on it forever inside a JSON value.
JSON_OPTIONS = {"whitespace_pattern": r"[ \n]{0,2}"}


@functools.cache
def _llguidance() -> tuple[ModuleType, ModuleType, "llg.LLParserLimits"]:
    """llguidance, its numpy helpers, and the matcher's default resource limits with errors that
    say what failed and not the parser state; imported the first time a grammar needs them."""
    import llguidance
    import llguidance.numpy
    return llguidance, llguidance.numpy, llguidance.LLParserLimits(verbose_errors=False)


def error_text(matcher: llg.LLMatcher) -> str:
    """A matcher's error as one line for a client: its first line (the rest is parser state)."""
    return matcher.get_error().strip().split("\n")[0].replace("<non-verbose/>", "").strip()


class _Vocabulary:
    """The duck-typed vocabulary llguidance.TokenizerWrapper reads."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        user_defined_tags = {i for i in tokenizer.user_defined_ids
                             if tokenizer.id_to_piece(i).startswith("<") and tokenizer.id_to_piece(i).endswith(">")}
        self.special_token_ids = sorted(set(tokenizer.special_ids) | user_defined_tags)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class GrammarEngine:
    def __init__(self, tokenizer: Tokenizer, n_vocab: int, threads: int = 1, reasoning_close: str | None = None):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._ll_tokenizer: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._executor: llg.LLExecutor | None = None
        # where a grammar that waits for the end of reasoning starts (GENERATE grammar_after_reasoning)
        self.think_close = tokenizer.piece_to_id(reasoning_close) if reasoning_close else None
        # the llguidance tokenizer (and the encoder it calls) is built with the first grammar: a
        # worker that never constrains a reply does not hold their copies of the vocabulary

    def ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()[0]
                stops = sorted(self.tokenizer.stop_ids) or [self.tokenizer.eos_id]
                self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(self.tokenizer)),
                                                     n_vocab=self.n_vocab, eos_token=stops)
            return self._ll_tokenizer

    def compile(self, kind: GrammarKind, source: str) -> str:
        """A serialized llguidance grammar, or InvalidRequestError naming what is wrong."""
        llg, _, limits = _llguidance()
        if kind == GrammarKind.JSON_OBJECT:
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(source)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc.msg}")
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("the JSON schema must be an object")
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema cannot be used: {exc}")
        elif kind == GrammarKind.REGEX:
            grammar = llg.LLMatcher.grammar_from_regex(source)
        elif kind == GrammarKind.LARK:
            grammar = llg.LLMatcher.grammar_from_lark(source)
        else:  # GrammarKind.LLGUIDANCE
            grammar = source
        error = llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer(), limits=limits)
        if error:
            raise InvalidRequestError(f"the {kind.replace('_', ' ')} does not compile: {error.strip()}")
        return grammar

    def matcher(self, grammar: str) -> llg.LLMatcher:
        """A matcher for a compiled grammar, tried first: a grammar that admits no text at all
        (``start: start``), or whose lexer blows up on its first steps (``a{1000000}``), is
        refused here, before a stream starts, rather than failing mid-reply."""
        llg, _, limits = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer(), grammar, limits=limits)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {error_text(matcher)}")
        tried = 0
        for _ in range(2):  # two steps: the first mask, and the one after the first token
            allowed = np.flatnonzero(self.masks([matcher])[0])
            if matcher.is_error() or allowed.size == 0:
                raise InvalidRequestError(self._refusal(matcher))
            if matcher.is_stopped():
                break
            if not matcher.consume_token(int(allowed[-1])):  # an allowed token: fails only on an error
                raise InvalidRequestError(self._refusal(matcher))
            tried += 1
        matcher.rollback(tried)
        return matcher

    def _refusal(self, matcher: llg.LLMatcher) -> str:
        why = error_text(matcher)
        if why == "NoExtensionBias" or not why:
            return ("the grammar admits no text the model could write (does every rule reach a terminal? "
                    "`start: start` never does)")
        return f"the grammar is too large to follow ({why}); simplify it or bound its repetitions"

    def compile_matcher(self, grammar: Grammar) -> "Future[llg.LLMatcher]":
        """Compile on the pool; the future holds the matcher or raises InvalidRequestError."""
        def compiled() -> llg.LLMatcher:
            started = time.perf_counter()
            try:
                return self.matcher(self.compile(grammar.kind, grammar.source))
            finally:
                metrics.GRAMMAR_COMPILE.observe(time.perf_counter() - started)

        return self.pool.submit(compiled)

    def masks(self, matchers: list[llg.LLMatcher]) -> np.ndarray:
        """Allowed-token masks [len(matchers), n_vocab] (bool), computed in one parallel call."""
        llg, llnp, _ = _llguidance()
        bitmask = llnp.allocate_token_bitmask(len(matchers), self.ll_tokenizer().vocab_size)
        with self._lock:
            if self._executor is None:
                self._executor = llg.LLExecutor()
        llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, :self.n_vocab].astype(bool)
