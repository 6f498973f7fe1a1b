"""Speculative decoding: drafted tokens verified in one weight pass, without changing a token.

A decoding stream feeds the model, after the token it sampled last, up to ``--spec-max`` drafted
tokens, and the pass returns the logits of every row fed. Row 0 is sampled as it would be
without speculation: the same sampler, penalties, grammar mask and random draw. While the token
sampled from row i is draft i, row i+1 (whose logits were computed after draft i) is sampled
too; the first token that differs, or the row after the last draft, ends the run. The cache then
forgets the drafts after the last accepted one.

Every draft here is deterministic: a lookup in what the stream has read and written
(``ngram``), or the most likely token of a draft model (``draft``) or of the served model's own
multi-token-prediction block (``mtp``). For a draft q that puts
all its mass on one token d, the speculative-sampling rule (accept d with probability
min(1, p(d)/q(d)), else draw from the residual max(0, p − q) renormalised) is exactly "draw from p;
the draft stands if the draw is d". So a reply is the one decoding without speculation writes,
token for token, at any temperature and seed: the kernels are batch-invariant, so row i's logits
are those a one-token pass would give, and one random draw is spent per token emitted, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from worker.speculation_settings import DRAFT, KINDS, MTP, NGRAM, SpeculationSettings

__all__ = ["DRAFT", "KINDS", "MTP", "NGRAM", "SpeculationSettings"]  # (whose drafters are made here)

NGRAM_SIZES = (4, 3, 2)  # suffix lengths looked up, longest first: a longer match drafts better
DRAFT_CHUNK = 256  # tokens a draft model reads per pass while it catches up with a stream


class Drafter(Protocol):
    """One stream's source of drafts: told every token the stream reads and writes (``extend``),
    asked for at most ``limit`` tokens to follow them (``propose``). One that reads the model's
    final states (``reads_states``) is given those of every pass of its stream (``took``)."""

    reads_states: bool

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, limit: int) -> list[int]: ...

    def took(self, at: int, states: np.ndarray) -> None: ...


def drafter(settings: SpeculationSettings, tokens: list[int], cache: Any) -> Drafter:
    """A new stream's drafter, seeded with what it has read so far (its prompt) and given its
    cache: the kinds asked for, each asked in turn until one drafts."""
    made = [NgramIndex(tokens) if kind == NGRAM else DraftModel(settings.draft_engine, tokens, cache.max_tokens)
            if kind == DRAFT else MtpDrafter(settings.model, cache, tokens) for kind in settings.kinds]
    return made[0] if len(made) == 1 else Combined(made, list(settings.kinds))


class Blind:
    """A drafter that does not read the model's states."""

    reads_states = False

    def took(self, at: int, states: np.ndarray) -> None:
        pass


class NgramIndex(Blind):
    """Where each short run of a stream's tokens last stood, to draft what followed it then.

    For every n of NGRAM_SIZES it maps the n tokens before position p to p, for the latest p
    that has a token after it; ``propose`` looks up the stream's last n tokens, longest n
    first, and drafts the tokens that followed their latest earlier occurrence."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        history = self.tokens
        for token in tokens:
            at = len(history)  # the new token's position: it follows the runs that end before it
            for n, table in self.after.items():
                if at >= n:
                    table[tuple(history[at - n:at])] = at
            history.append(token)

    def propose(self, limit: int) -> list[int]:
        history = self.tokens
        for n, table in self.after.items():
            if len(history) < n:
                continue
            start = table.get(tuple(history[-n:]))
            if start is not None:
                return history[start:start + limit]
        return []


class DraftModel(Blind):
    """Drafts from a small model of the same vocabulary, its most likely token each time (so a
    draft is deterministic). It keeps a cache of its own per stream, cut back to what the stream
    has kept and caught up before it drafts; one weight pass of the small model per token drafted."""

    def __init__(self, engine: Any, tokens: Iterable[int], max_tokens: int):
        self.engine = engine
        self.tokens: list[int] = list(tokens)
        self.cache = engine.new_cache(max_tokens)  # as long as the stream's: it grows as it is written

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        cache, model = self.cache, self.engine.model
        cache.truncate(cache.common_prefix(self.tokens[:-1]))  # the last token is read with the first draft
        behind = self.tokens[cache.length:]
        for start in range(0, len(behind) - 1, DRAFT_CHUNK):
            model.forward([(cache, behind[start:min(start + DRAFT_CHUNK, len(behind) - 1)])])
        feed, drafts = [self.tokens[-1]], []
        while len(drafts) < limit:
            logits = model.forward([(cache, feed)])[0]
            feed = [int(logits.argmax())]
            drafts += feed
        return drafts


class MtpDrafter:
    """Drafts from the served model's multi-token-prediction block (Qwen3.5's ``nextn`` layers):
    the block reads each token the stream keeps with the model's final state at the position
    before it, in an MTP cache of its own, and drafts by chaining its most likely tokens
    (``model.mtp_draft``).

    The states come from the stream's own passes (``took``: the rows of one pass, of which the
    stream keeps those its cache still holds at the next pass). Positions its passes did not
    compute (a prefix reused from a slot, the kvstore or a cartridge, a prompt that was scored)
    are read with zero states: their drafts are weaker, never wrong, as every draft is verified."""

    reads_states = True

    def __init__(self, model: Any, cache: Any, tokens: Iterable[int] = ()):
        self.model, self.cache = model, cache  # the stream's cache: the tokens it holds
        self.state = model.new_mtp_state(cache.max_tokens)
        self.unread: tuple[int, np.ndarray] | None = None  # the last pass's first position and states
        self.last: int | None = None  # the stream's newest token: drafts follow it
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for self.last in tokens:  # the others are read with their states (took) once the cache holds them
            pass

    def took(self, at: int, states: np.ndarray) -> None:
        if self.unread is not None and self.unread[0] < at:
            self.read(at)  # the pass before: what of it the stream kept lies before this one
        self.unread = (at, states)  # the same pass run again (alone, after a batch failed) replaces it

    def propose(self, limit: int) -> list[int]:
        if self.last is None or limit <= 0:
            return []
        self.read()
        self.catch_up(self.cache.length)
        return self.model.mtp_draft(self.state, self.last, limit)

    def read(self, end: int | None = None) -> None:
        """The rows of the last pass that the stream kept (those its cache holds before ``end``,
        where the next pass began), into the MTP cache."""
        if self.unread is None:
            return
        (at, states), self.unread = self.unread, None
        kept = min(len(states), (self.cache.length if end is None else end) - at)
        if kept > 0:
            self.catch_up(at)
            self.model.mtp_accept(self.state, self.cache.tokens[at:at + kept], states[:kept])

    def catch_up(self, upto: int) -> None:
        """The MTP cache made to hold the stream's positions before ``upto``; the positions
        without states read with zeros. (A stream's cache only loses drafts it never kept, so the
        MTP cache, which reads only kept tokens, never holds what the stream's does not.)"""
        mtp = self.state.cache
        if mtp.length > upto:
            mtp.truncate(upto)
            self.state.last_hidden = np.zeros_like(self.state.last_hidden)
        if mtp.length < upto:
            n_vocab = self.model.hp.n_vocab
            gap = [t if 0 <= t < n_vocab else 0 for t in self.cache.tokens[mtp.length:upto]]  # a cartridge's pseudo-ids as 0
            self.model.mtp_accept(self.state, gap, np.zeros((len(gap), self.model.hp.n_embd), dtype=np.float32))


class Combined:
    """Several drafters in order of preference: the first that drafts anything is used."""

    def __init__(self, drafters: list[Drafter], kinds: list[str]):
        self.drafters, self.kinds = drafters, kinds
        self.kind = kinds[0]  # which drafted last, for the metrics
        self.reads_states = any(d.reads_states for d in drafters)

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        for drafter in self.drafters:
            drafter.extend(tokens)

    def took(self, at: int, states: np.ndarray) -> None:
        for drafter in self.drafters:
            drafter.took(at, states)

    def propose(self, limit: int) -> list[int]:
        for drafter, kind in zip(self.drafters, self.kinds):
            drafts = drafter.propose(limit)
            if drafts:
                self.kind = kind
                return drafts
        return []


@dataclass
class StreamSpeculation:
    """A stream's speculation: its drafter's state, what the pass in flight drafted, its counts."""

    index: Drafter
    kind: str = NGRAM
    drafts: list[int] = field(default_factory=list)  # fed after next_token in the pass in flight
    # a cache that cannot rewind (recurrent states): its length and states before the pass
    checkpoint: tuple[int, object] | None = None
    drafted: int = 0
    accepted: int = 0
    recent_miss: int = 0  # passes in a row whose first draft was refused

    def count(self, drafted: int, stood: int) -> None:
        self.drafted += drafted
        self.accepted += stood
        self.recent_miss = self.recent_miss + 1 if drafted and not stood else 0

    def limit(self, most: int) -> int:
        """Drafts to try now: the full count while drafts land, fewer after misses (a row costs
        compute; a stream that never repeats itself should pay little for trying)."""
        return max(1, most >> min(self.recent_miss, 3))
