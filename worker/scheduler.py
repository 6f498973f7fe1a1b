"""Admission queue and the decode loop: which streams run, one weight pass per step.

Threads: the worker's IO thread calls ``submit`` / ``abort`` / ``abort_gateway``; the engine
thread runs ``run``. They share only the waiting deque, the abort set and the stream table,
under one lock. Outgoing messages go through ``send`` (thread-safe, provided by the server).

A step feeds every running stream at once: decoding streams their last sampled token, and
at most ``prefill_chunk`` prompt tokens to streams still reading their prompt, so a long
prompt never stalls the others for more than one chunk's time. With ``batch == 1`` this is the
plain sequential server. An idle worker starts a request as soon as it arrives.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shared.errors import InvalidRequestError
from shared.protocol import (
    Accepted,
    Busy,
    Finished,
    FinishReason,
    Generate,
    Message,
    Rejected,
    Tokens,
)
from shared.sampling_params import SamplingParams
from worker.engine.engine import Engine
from worker.engine.sampling import Sampler
from worker.kv_slots import Slot, SlotPool

log = logging.getLogger("lmserve.worker")

Sender = Callable[[bytes, Message], None]


@dataclass
class SchedulerSettings:
    ctx: int = 4096  # per-request budget: prompt + completion
    queue: int = 16  # waiting requests beyond which new ones get BUSY
    batch: int = 1  # streams decoded together
    kv_slots: int = 1  # resident caches (at least batch)
    prefill_chunk: int = 256  # prompt tokens per step while others decode


@dataclass
class Stream:
    gateway: bytes
    request: Generate
    params: SamplingParams
    sampler: Sampler
    stop_ids: set[int]
    slot: Slot | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet in the cache
    next_token: int | None = None  # sampled, sent, not yet fed to the model
    cached: int = 0
    completion: int = 0
    aborted: bool = False

    @property
    def key(self) -> tuple[bytes, str]:
        return self.gateway, self.request.request_id


class Scheduler:
    def __init__(self, engine: Engine, settings: SchedulerSettings, send: Sender):
        self.engine = engine
        self.settings = settings
        self.send = send
        self.pool = SlotPool(engine.model, max(settings.kv_slots, settings.batch), settings.ctx)
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.waiting: deque[Stream] = deque()
        self.running: list[Stream] = []
        self.streams: dict[tuple[bytes, str], Stream] = {}
        self.stopping = False
        self.steps = 0  # forward passes run, for tests and stats

    # --- called from the IO thread --------------------------------------------------------------

    def submit(self, gateway: bytes, request: Generate) -> None:
        """Answer ACCEPTED, BUSY or REJECTED at once; accepted streams join the queue."""
        rid = request.request_id
        try:
            stream = self._validate(gateway, request)
        except InvalidRequestError as exc:
            self.send(gateway, Rejected(rid, exc.status, exc.kind, exc.message))
            return
        with self.lock:
            if stream.key in self.streams:
                self.send(gateway, Rejected(rid, 400, "invalid_request_error",
                                            f"request id {rid!r} is already in flight"))
                return
            # streams that would have to wait, this one included, once the free batch places fill
            would_wait = len(self.waiting) + 1 - max(0, self.settings.batch - len(self.running))
            if would_wait > self.settings.queue:
                self.send(gateway, Busy(rid, 1.0, f"the worker's queue is full "
                                                  f"({len(self.waiting)} waiting, --queue {self.settings.queue})"))
                return
            self.send(gateway, Accepted(rid, len(self.waiting)))
            self.streams[stream.key] = stream
            self.waiting.append(stream)
        self.wakeup.set()

    def abort(self, gateway: bytes, request_id: str) -> None:
        with self.lock:
            stream = self.streams.get((gateway, request_id))
            if stream is None:
                return
            if stream in self.waiting:  # never started: finish it here, ahead of the queue
                self.waiting.remove(stream)
                del self.streams[stream.key]
                self.send(gateway, Finished(request_id, FinishReason.ABORT.value,
                                            len(stream.request.prompt), 0, 0))
                return
            stream.aborted = True
        self.wakeup.set()

    def abort_gateway(self, gateway: bytes) -> int:
        """A gateway went silent: end everything it asked for. Returns how many streams."""
        with self.lock:
            keys = [k for k in self.streams if k[0] == gateway]
        for _, request_id in keys:
            self.abort(gateway, request_id)
        return len(keys)

    def load(self) -> tuple[int, int]:
        with self.lock:
            return len(self.waiting), len(self.running)

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()

    def _validate(self, gateway: bytes, request: Generate) -> Stream:
        prompt = request.prompt
        n_vocab = self.engine.model.hp.n_vocab
        if not prompt:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        ids = np.asarray(prompt)
        if ids.min() < 0 or ids.max() >= n_vocab:
            raise InvalidRequestError(f"prompt token ids must lie in 0..{n_vocab - 1}")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1")
        if len(prompt) >= self.settings.ctx:
            raise InvalidRequestError(
                f"prompt is too long: {len(prompt)} tokens > {self.settings.ctx - 1} maximum "
                f"(the context budget --ctx is {self.settings.ctx} tokens, prompt and completion together)")
        if request.grammar is not None:
            raise InvalidRequestError("constrained decoding (grammar) is not available in this worker")
        if request.cartridge_ids:
            raise InvalidRequestError("cartridges are not available in this worker")
        params = request.sampling_params()  # raises InvalidRequestError on bad values
        stop_ids = set(request.stop_ids) if request.stop_ids is not None else set(self.engine.tokenizer.stop_ids)
        return Stream(gateway, request, params, Sampler(params, prompt), stop_ids)

    # --- the engine thread ------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            self._admit()
            if not self.running:
                self.wakeup.wait(0.05)
                self.wakeup.clear()
                continue
            self._step()

    def _admit(self) -> None:
        with self.lock:
            while self.waiting and len(self.running) < self.settings.batch:
                stream = self.waiting[0]
                choice = self.pool.acquire(stream.request.prompt, stream.request.cache_hint)
                if choice is None:
                    break
                self.waiting.popleft()
                stream.slot = choice.slot
                stream.cached = choice.reused_tokens
                stream.pending = list(stream.request.prompt[choice.reused_tokens:])
                self.running.append(stream)

    def _step(self) -> None:
        for stream in [s for s in self.running if s.aborted]:
            self._finish(stream, FinishReason.ABORT)
        batch: list[tuple[Stream, list[int]]] = []
        prefill_budget = self.settings.prefill_chunk
        for stream in self.running:
            if stream.pending:
                if prefill_budget <= 0:
                    continue
                chunk = stream.pending[:prefill_budget]
                prefill_budget -= len(chunk)
                batch.append((stream, chunk))
            elif stream.next_token is not None:
                batch.append((stream, [stream.next_token]))
        if not batch:
            return
        results = self._forward(batch)
        self.steps += 1
        for (stream, tokens), logits in zip(batch, results):
            if logits is None:
                continue  # already finished with an error
            if stream.pending:
                del stream.pending[:len(tokens)]
                if stream.pending:
                    continue  # more prompt to read before the first token
            self._emit(stream, logits)

    def _forward(self, batch: list[tuple[Stream, list[int]]]) -> list[np.ndarray | None]:
        """One weight pass for the batch; if it fails, retry each stream alone so only the
        stream at fault ends (its cache writes past ``length`` were never committed)."""
        try:
            return self.engine.model.forward([(s.slot.cache, toks) for s, toks in batch])
        except Exception:
            if len(batch) == 1:
                log.exception("forward pass failed for %s", batch[0][0].request.request_id)
                self._finish(batch[0][0], FinishReason.ERROR, "the engine failed on this request")
                return [None]
        results: list[np.ndarray | None] = []
        for stream, tokens in batch:
            try:
                results.append(self.engine.model.forward([(stream.slot.cache, tokens)])[0])
            except Exception:
                log.exception("forward pass failed for %s", stream.request.request_id)
                self._finish(stream, FinishReason.ERROR, "the engine failed on this request")
                results.append(None)
        return results

    def _emit(self, stream: Stream, logits: np.ndarray) -> None:
        request = stream.request
        try:
            token = stream.sampler.sample(logits)
        except Exception as exc:
            log.exception("sampling failed for %s", request.request_id)
            self._finish(stream, FinishReason.ERROR, f"sampling failed: {exc}")
            return
        stream.completion += 1
        wants_logprobs = stream.params.logprobs or stream.params.top_logprobs
        self.send(stream.gateway, Tokens(
            request.request_id, [token.token_id],
            [token.logprob] if wants_logprobs else None,
            [[[i, lp] for i, lp in token.top_logprobs]] if stream.params.top_logprobs else None,
            stream.cached if stream.completion == 1 else None))
        if token.token_id in stream.stop_ids:
            self._finish(stream, FinishReason.STOP)
        elif stream.completion >= request.max_tokens:
            self._finish(stream, FinishReason.LENGTH)
        elif len(request.prompt) + stream.completion >= self.settings.ctx:
            self._finish(stream, FinishReason.CONTEXT)
        else:
            stream.next_token = token.token_id

    def _finish(self, stream: Stream, reason: FinishReason, error: str | None = None) -> None:
        with self.lock:
            if stream in self.running:
                self.running.remove(stream)
            self.streams.pop(stream.key, None)
        if stream.slot is not None:
            self.pool.release(stream.slot)
        self.send(stream.gateway, Finished(
            stream.request.request_id, reason.value, len(stream.request.prompt), stream.cached,
            stream.completion, error))
