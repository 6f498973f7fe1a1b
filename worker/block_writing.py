"""Text-diffusion streams in the step loop: a reply written a block at a time
(``worker/diffusion.py`` says how one block is denoised).

A stream that has read its prompt (or its last block) starts a canvas; every step runs one
denoising pass for all canvases together; a finished block is sent, cut at its first
end-of-turn token or at max_tokens, and, unless the reply ended there, read into the cache like
a prompt before the next block starts. A reasoning budget that runs out inside a block cuts the
block there and writes the convention's closing marker in its place: the next block, read after
it, is the answer.
"""

from __future__ import annotations

import logging

import numpy as np

from shared.protocol import FinishReason, Tokens
from worker import metrics
from worker.decoding import Decoding
from worker.diffusion import CanvasWriter
from worker.engine.model import DecoderModel
from worker.passes import together_else_alone
from worker.stream import Stream

log = logging.getLogger("lmserve.worker")


class BlockWriting:
    def __init__(self, decoding: Decoding):
        """Blocks go out as ``decoding`` sends tokens, under its streams' reasoning budgets."""
        self.model: DecoderModel = decoding.model
        self.ctx = decoding.ctx
        self.send = decoding.send
        self.finish = decoding.finish
        self.budget_of = decoding.budget_of

    def denoise(self, streams: list[Stream]) -> list[np.ndarray | None]:
        """One denoising pass for every block being written, in one weight pass."""
        return together_else_alone(
            streams, lambda s: s,
            lambda group: self.model.denoise([(s.slot.cache, s.writer.canvas.tolist(), s.writer.probs) for s in group]),
            lambda s: self.finish(s, FinishReason.ERROR, "the engine failed on this request"))

    def take(self, stream: Stream, logits: np.ndarray) -> None:
        """A denoising pass's logits into the stream's canvas; a finished block is written."""
        try:
            stream.writer.advance(logits)
            if stream.writer.done:
                self.write_block(stream)
        except Exception as exc:
            log.exception("writing a block failed for %s", stream.request.request_id)
            self.finish(stream, FinishReason.ERROR, f"writing a block failed: {exc}")

    def start_block(self, stream: Stream) -> None:
        """A stream has read its prompt or its last block: a new canvas, as long as the context
        has room for one (a shorter one where it has less)."""
        if stream.done:
            return
        room = self.ctx - (stream.prefix + len(stream.request.prompt) + stream.completion)
        length = min(self.model.settings.canvas_length, room)
        if length <= 0:
            self.finish(stream, FinishReason.CONTEXT, None)
            return
        stream.writer = CanvasWriter(self.model.settings, self.model.hp.n_vocab, length, stream.params, stream.rng)

    def within_budget(self, stream: Stream, block: list[int]) -> list[int]:
        """The block as far as the stream's reasoning budget lets it go: where the budget runs
        out, the closing marker the budget forces ends the block instead of what was written."""
        budget = self.budget_of(stream)
        if budget is None:
            return block
        kept = []
        for token in block:
            if budget.forced() is not None:
                break
            budget.took(token)
            kept.append(token)
        while (forced := budget.forced()) is not None:
            budget.took(forced)
            kept.append(forced)
        return kept

    def write_block(self, stream: Stream) -> None:
        """Send a finished block, cut after its first end-of-turn token or at max_tokens; the
        reply ends there, or the block is read into the cache before the next one starts."""
        request, block = stream.request, stream.writer.written()
        stream.writer = None
        kept = self.within_budget(stream, block)[:request.max_tokens - stream.completion]
        stop = next((i for i, token in enumerate(kept) if token in stream.stop_ids), None)
        if stop is not None:
            kept = kept[:stop + 1]
        stream.completion += len(kept)
        first = stream.completion == len(kept)
        self.send(stream.gateway, Tokens(request.request_id, kept, cached_tokens=stream.cached if first else None))
        metrics.STEP_TOKENS.labels("decode").inc(len(kept))
        reason = stream.end_reason(stop is not None, self.ctx)
        if reason is not None:
            self.finish(stream, reason, None)
        else:
            stream.pending = list(kept)  # the encoder reads the block, then the next one starts
