"""Autoregressive decoding of the streams of a step: what each feeds the model, and what is done
with the logits it gets back (grammar masks, sampling, the grammar's advance, the TOKENS sent).

This is where a decoding strategy lives. Today a decoding stream feeds the one token it sampled
last and takes one token from the last row's logits; a strategy that verifies several tokens per
weight pass (speculative decoding) feeds its drafts after that token in ``feed`` and accepts
from the rows it gets back in ``advance``, and the scheduler's step loop stays as it is.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from shared.protocol import FinishReason, Tokens, TopLogprob
from worker.grammar import GrammarEngine, error_text
from worker.stream import Finish, Send, Stream

SLOW_MASKS = 1.0  # seconds: a step whose grammar masks take longer is logged with its streams
log = logging.getLogger("lmserve.worker")



class Decoding:
    def __init__(self, grammar: GrammarEngine | None, ctx: int, send: Send, finish: Finish):
        self.grammar = grammar
        self.ctx = ctx
        self.send = send
        self.finish = finish

    def feed(self, stream: Stream) -> list[int]:
        """The tokens a decoding stream puts through the next weight pass."""
        return [stream.next_token]

    def advance(self, sampled: list[tuple[Stream, np.ndarray]]) -> None:
        """Each stream's next token from its logits, within its grammar, sent to its gateway."""
        masks = self.masks([s for s, _ in sampled])
        for stream, logits in sampled:
            self.emit(stream, logits, masks.get(id(stream)))

    def masks(self, streams: list[Stream]) -> dict[int, np.ndarray]:
        """One bitmask computation for every constrained stream of this step; if that fails,
        each stream's mask alone, so only a stream whose matcher is at fault ends."""
        constrained = [s for s in streams if s.matcher is not None and s.grammar_active]
        if not constrained:
            return {}
        try:
            started = time.perf_counter()
            rows = self.grammar.masks([s.matcher for s in constrained])
            spent = time.perf_counter() - started
            if spent > SLOW_MASKS:  # every stream of the batch waited this long for the grammars
                log.warning("grammar masks took %.1f s in one step (%s)", spent,
                            ", ".join(s.request.request_id for s in constrained))
            return {id(stream): row for stream, row in zip(constrained, rows)}
        except Exception:
            log.exception("computing the batch's grammar masks failed; retrying stream by stream")
        masks = {}
        for stream in constrained:
            try:
                masks[id(stream)] = self.grammar.masks([stream.matcher])[0]
            except Exception as exc:
                self.finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {exc}")
        return masks

    def emit(self, stream: Stream, logits: np.ndarray, allowed: np.ndarray | None = None) -> None:
        request = stream.request
        if stream.done:
            return  # ended while its mask was computed
        if stream.matcher is not None and stream.grammar_active and stream.matcher.is_error():
            self.finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {error_text(stream.matcher)}")
            return
        try:
            token = stream.sampler.sample(logits, allowed)
        except Exception as exc:
            log.exception("sampling failed for %s", request.request_id)
            self.finish(stream, FinishReason.ERROR, f"sampling failed: {exc}")
            return
        grammar_done = False
        if stream.matcher is not None and token.token_id not in stream.stop_ids:
            if stream.grammar_active:
                # A token the grammar refuses is never shown: the stream ends before it.
                if not stream.matcher.consume_token(token.token_id):
                    self.finish(stream, FinishReason.ERROR,
                                f"the grammar matcher failed: {error_text(stream.matcher) or 'token refused'}")
                    return
                grammar_done = stream.matcher.is_stopped()  # nothing but end-of-turn may follow
            elif token.token_id == self.grammar.think_close:
                stream.grammar_active = True  # the reasoning block ended: the grammar starts now
        stream.completion += 1
        wants_logprobs = stream.params.logprobs or stream.params.top_logprobs
        self.send(stream.gateway, Tokens(
            request.request_id, [token.token_id],
            [token.logprob] if wants_logprobs else None,
            [[TopLogprob(i, lp) for i, lp in token.top_logprobs]] if stream.params.top_logprobs else None,
            stream.cached if stream.completion == 1 else None))
        reason = stream.end_reason(token.token_id in stream.stop_ids or grammar_done, self.ctx)
        if reason is not None:
            self.finish(stream, reason, None)
        else:
            stream.next_token = token.token_id
