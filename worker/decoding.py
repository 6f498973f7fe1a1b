"""Autoregressive decoding of the streams of a step: what each feeds the model, and what is done
with the logits it gets back (grammar masks, sampling, the grammar's advance, the TOKENS sent).

A decoding stream feeds the token it sampled last and, where speculation is on, the tokens
drafted after it (``worker/speculation.py`` says why the reply stays the one decoding without
speculation would write); ``advance`` samples the rows in order while the drafts stand, and
the cache forgets the rest.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from shared.protocol import FinishReason, Tokens, TopLogprob
from worker import metrics
from worker.engine.model import DecoderModel
from worker.grammar import GrammarEngine, error_text
from worker.reasoning_budget import ReasoningBudget, ReasoningMarkers
from worker.speculation import Drafter, SpeculationSettings, StreamSpeculation, drafter
from worker.stream import Finish, Send, Stream

SLOW_MASKS = 1.0  # seconds: a step whose grammar masks take longer is logged with its streams
log = logging.getLogger("lmserve.worker")


class Decoding:
    def __init__(self, model: DecoderModel, grammar: GrammarEngine | None, ctx: int, send: Send, finish: Finish,
                 speculation: SpeculationSettings | None = None):
        self.model = model
        self.grammar = grammar
        self.ctx = ctx
        self.send = send
        self.finish = finish
        self.speculation = speculation if speculation is not None and speculation.on else None
        # the model's reasoning markers, which reasoning budgets close blocks with (set by the server)
        self.reasoning: ReasoningMarkers | None = None

    # --- what a stream feeds ------------------------------------------------------------------

    def feed(self, stream: Stream) -> list[int]:
        """The tokens a decoding stream puts through the next weight pass: the one it sampled
        last, then what is drafted after it."""
        spec = self.speculation_of(stream)
        if spec is None:
            return [stream.next_token]
        # every row fed may become a token: no more than the reply and the context still allow
        written = stream.prefix + len(stream.request.prompt) + stream.completion
        room = min(stream.request.max_tokens - stream.completion, self.ctx - written) - 1
        drafts = spec.index.propose(min(spec.limit(self.speculation.max_draft), room)) if room > 0 else []
        spec.kind = getattr(spec.index, "kind", spec.kind)  # of several kinds, the one that drafted
        if drafts and stream.matcher is not None and stream.grammar_active:
            drafts = drafts[:stream.matcher.validate_tokens(drafts)]  # a token the grammar forbids ends them
        spec.drafts = drafts
        cache = stream.slot.cache
        spec.checkpoint = (cache.length, cache.checkpoint()) if drafts and not cache.rewindable else None
        return [stream.next_token, *drafts]

    def speculation_of(self, stream: Stream) -> StreamSpeculation | None:
        """A stream's speculation, begun at its first pass; None where it does not speculate
        (off here, or in its request)."""
        if stream.spec is None and self.speculation is not None and stream.request.speculate:
            read = [*stream.request.prompt, *([] if stream.next_token is None else [stream.next_token])]
            stream.spec = StreamSpeculation(drafter(self.speculation, read, stream.slot.cache), self.speculation.kinds[0])
        return stream.spec

    def budget_of(self, stream: Stream) -> ReasoningBudget | None:
        """A stream's reasoning budget, begun at its first token; None where it has none (or the
        model has no reasoning markers to close a block with)."""
        budget = stream.request.reasoning_budget
        if stream.budget is None and budget is not None and self.reasoning is not None:
            stream.budget = ReasoningBudget(self.reasoning, budget, stream.request.prompt)
        return stream.budget

    def passing(self, batch: list[tuple[Stream, list[int]]]) -> tuple[dict[int, int], dict[int, Drafter],
                                                                      dict[int, tuple[np.ndarray, np.ndarray]]]:
        """What a pass over the batch must give back instead of each stream's last logits: the
        rows of the streams verifying drafts (how many), none for a stream whose prompt goes on
        past this chunk, the final states of the streams whose drafters read them (to whom), and
        which verifying streams take only each row's largest logit, with the logit bias to add
        first: greedy ones, with no grammar or reasoning budget to shape a row (a row of a 262k
        vocabulary's logits is 1 MiB; four streams verifying 16 drafts held 68 of them at once)."""
        tails = {id(s): len(toks) for s, toks in batch if not s.pending and len(toks) > 1}
        best = {id(s): s.sampler.bias for s, toks in batch if id(s) in tails and s.sampler.greedy
                and s.matcher is None and s.request.reasoning_budget is None}
        # a prompt chunk with more of the prompt after it: its logits would go unread
        tails.update({id(s): 0 for s, toks in batch if len(toks) < len(s.pending)})
        readers = {id(s): spec.index for s, _ in batch
                   if (spec := self.speculation_of(s)) is not None and spec.index.reads_states}
        return tails, readers, best

    # --- what it gets back --------------------------------------------------------------------

    def advance(self, sampled: list[tuple[Stream, np.ndarray]]) -> None:
        """Each stream's next token(s) from its logits, within its grammar, sent to its gateway."""
        masks = self.masks([s for s, _ in sampled])
        for stream, logits in sampled:
            if logits.ndim == 1 and logits.dtype.kind == "f":  # one row's logits (else rows, or rows' choices)
                self.emit(stream, logits, masks.get(id(stream)))
            else:
                self.verify(stream, logits, masks.get(id(stream)))

    def verify(self, stream: Stream, rows: np.ndarray, allowed: np.ndarray | None) -> None:
        """Sample the rows of a pass that fed drafts, in order, while the drafts stand; then
        make the cache hold the fed token and the drafts that stood, nothing after."""
        spec, cache = stream.spec, stream.slot.cache
        drafts, spec.drafts = spec.drafts, []
        fed_at = cache.length - len(rows)  # where the token sampled last went
        fed = cache.tokens[fed_at:]
        stood = 0
        for i, row in enumerate(rows):
            if i and stream.matcher is not None and stream.grammar_active:
                allowed = self.mask_alone(stream)
            token = None if stream.done else self.emit(stream, row, allowed)
            if token is None or i == len(drafts) or token != drafts[i]:
                break
            stood += 1
        spec.count(len(drafts), stood)
        metrics.SPEC_TOKENS.labels(spec.kind, "drafted").inc(len(drafts))
        metrics.SPEC_TOKENS.labels(spec.kind, "accepted").inc(stood)
        keep = fed_at + 1 + stood
        if keep >= cache.length:
            return
        if cache.rewindable:
            cache.truncate(keep)
            return
        # recurrent states hold every token read: back to those before the pass, then read again
        length, states = spec.checkpoint
        cache.rewind(length, states)
        if stream.done:
            return
        try:
            self.model.forward([(cache, fed[:1 + stood])])
        except Exception:
            log.exception("reading the accepted drafts again failed for %s", stream.request.request_id)
            self.finish(stream, FinishReason.ERROR, "the engine failed on this request")

    def mask_alone(self, stream: Stream) -> np.ndarray | None:
        try:
            return self.grammar.masks([stream.matcher])[0]
        except Exception as exc:
            self.finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {exc}")
            return None

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

    def emit(self, stream: Stream, logits: np.ndarray, allowed: np.ndarray | None = None) -> int | None:
        """Sample a token, send it, and end the stream where its reply is over; the token, or
        None where none was sampled."""
        request = stream.request
        if stream.done:
            return None  # ended while its mask was computed
        if stream.matcher is not None and stream.grammar_active and stream.matcher.is_error():
            self.finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {error_text(stream.matcher)}")
            return None
        budget = self.budget_of(stream)
        forced = budget.forced() if budget is not None else None
        if forced is not None and allowed is not None and not allowed[forced]:
            forced = None  # a grammar that holds the reasoning too, and does not let it close here
        try:
            if logits.dtype.kind == "i":  # the pass chose already (a greedy stream's ``passing``)
                token = stream.sampler.take(int(logits))
            else:
                token = (stream.sampler.sample(logits, allowed) if forced is None
                         else stream.sampler.force(logits, forced, allowed))
        except Exception as exc:
            log.exception("sampling failed for %s", request.request_id)
            self.finish(stream, FinishReason.ERROR, f"sampling failed: {exc}")
            return None
        grammar_done = False
        if stream.matcher is not None and token.token_id not in stream.stop_ids:
            if stream.grammar_active:
                # A token the grammar refuses is never shown: the stream ends before it.
                if not stream.matcher.consume_token(token.token_id):
                    self.finish(stream, FinishReason.ERROR,
                                f"the grammar matcher failed: {error_text(stream.matcher) or 'token refused'}")
                    return None
                grammar_done = stream.matcher.is_stopped()  # nothing but end-of-turn may follow
            elif token.token_id == self.grammar.think_close:
                stream.grammar_active = True  # the reasoning block ended: the grammar starts now
        if budget is not None:
            budget.took(token.token_id)
        stream.completion += 1
        wants_logprobs = stream.params.logprobs or stream.params.top_logprobs
        self.send(stream.gateway, Tokens(
            request.request_id, [token.token_id],
            [token.logprob] if wants_logprobs else None,
            [[TopLogprob(i, lp) for i, lp in token.top_logprobs]] if stream.params.top_logprobs else None,
            stream.cached if stream.completion == 1 else None))
        if stream.spec is not None:
            stream.spec.index.extend([token.token_id])
        reason = stream.end_reason(token.token_id in stream.stop_ids or grammar_done, self.ctx)
        if reason is not None:
            self.finish(stream, reason, None)
        else:
            stream.next_token = token.token_id
        return token.token_id
