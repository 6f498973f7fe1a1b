"""Weight passes that fail one stream, not the batch: a pass runs for every stream together; if
it fails, each stream runs alone, so only the stream at fault ends (``fail`` ends it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from worker.engine.model import DecoderModel
from worker.scoring import score_rows
from worker.speculation import Drafter
from worker.stream import Stream

log = logging.getLogger("lmserve.worker")

Item = TypeVar("Item")
Fail = Callable[[Stream], None]  # ends a stream whose pass failed


def together_else_alone(items: Sequence[Item], stream_of: Callable[[Item], Stream],
                        run: Callable[[Sequence[Item]], list[np.ndarray]], fail: Fail,
                        before_alone: Callable[[], None] = lambda: None) -> list[np.ndarray | None]:
    """``run`` over all items; if that fails, ``before_alone`` undoes what it moved on, and each
    item runs alone (None where it fails too). A single item is not run twice."""
    try:
        return run(items)
    except Exception:
        if len(items) == 1:
            log.exception("the pass failed for %s", stream_of(items[0]).request.request_id)
            fail(stream_of(items[0]))
            return [None]
        log.exception("a pass of %d streams failed; running each alone", len(items))
    before_alone()
    results: list[np.ndarray | None] = []
    for item in items:
        try:
            results.append(run([item])[0])
        except Exception:
            log.exception("the pass failed for %s", stream_of(item).request.request_id)
            fail(stream_of(item))
            results.append(None)
    return results


def forward(model: DecoderModel, batch: list[tuple[Stream, list[int]]], fail: Fail,
            tails: dict[int, int] | None = None, readers: dict[int, Drafter] | None = None,
            best: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> list[np.ndarray | None]:
    """One weight pass for the batch, each stream's tokens appended to its cache; per stream the
    last row's logits, or its last ``tails[id(stream)]`` rows' where that is given (a stream
    verifying drafts), their largest biased logits' indices instead for the streams in ``best``
    (greedy ones, with their logit bias), and the final states of its rows to
    ``readers[id(stream)]`` where that is given (a drafter that reads them). Retried stream by
    stream from the caches' checkpoints."""
    checkpoints = [s.slot.cache.checkpoint() for s, _ in batch] if len(batch) > 1 else []
    tails, readers, best = tails or {}, readers or {}, best or {}

    def roll_back() -> None:
        for (stream, _), checkpoint in zip(batch, checkpoints):
            stream.slot.cache.roll_back(checkpoint)

    def run(items: Sequence[tuple[Stream, list[int]]]) -> list[np.ndarray]:
        starts = [s.slot.cache.length for s, _ in items]
        states: list[np.ndarray] | None = [] if any(id(s) in readers for s, _ in items) else None
        logits = model.forward([(s.slot.cache, toks) for s, toks in items],
                               tails=[tails.get(id(s), 1) for s, _ in items], hidden_out=states,
                               best=[best.get(id(s)) for s, _ in items] if best else None)
        for (stream, _), at, rows in zip(items, starts, states or ()):
            if id(stream) in readers:
                readers[id(stream)].took(at, rows)
        return logits

    return together_else_alone(batch, lambda item: item[0], run, fail, roll_back)


def score(model: DecoderModel, stream: Stream, tokens: list[int], fail: Fail) -> np.ndarray | None:
    """A prompt chunk's pass with the logits of every row: each row scores the prompt token
    after it (into ``stream.scores``). The last row's logits, which go on to the first
    generated token."""
    rows = together_else_alone([tokens], lambda _: stream,
                               lambda items: model.forward([(stream.slot.cache, items[0])], all_logits=True), fail)[0]
    if rows is None:
        return None
    start = len(stream.request.prompt) - len(stream.pending)  # the chunk's first position in the prompt
    stream.scores.extend(score_rows(rows, stream.request.prompt, start, stream.request.prompt_logprobs))
    return rows[-1]
