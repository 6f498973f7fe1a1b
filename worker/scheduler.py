"""Admission queue and the step loop: which streams run, one weight pass per step.

Threads: the IO thread calls ``submit`` / ``abort`` / ``abort_gateway``, the engine thread ``run``; they share only
the waiting deque, the abort set and the stream table, under one lock, and both send through the server's ``send``.

A step feeds every running stream at once: decoding streams what ``worker/decoding.py`` gives them (their
last sampled token), and at most ``prefill_chunk`` prompt tokens to streams still reading their prompt, so a
long prompt never stalls the others for more than one chunk's time. With ``batch == 1`` this is the plain
sequential server. Elsewhere: checking a request (``worker/stream.py``), its cartridges
(``worker/cartridges/choice.py``), passes that fail one stream only (``worker/passes.py``), sampling and
grammars (``worker/decoding.py``), text-diffusion blocks (``worker/block_writing.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidRequestError, LmserveError
from shared.protocol import DEFAULT_QUEUE, Accepted, Busy, Finished, FinishReason, Generate, Rejected, Tokens
from worker import metrics, passes
from worker.block_writing import BlockWriting
from worker.cartridges.cartridge import Cartridge
from worker.cartridges.choice import CartridgeChoice
from worker.cartridges.fleet import Fleet
from worker.decoding import Decoding
from worker.engine import Engine, kernels
from worker.grammar import GrammarEngine
from worker.kv_slots import SlotPool, resident_slot_count
from worker.kv_spill import KVSpiller
from worker.scripted import ScriptedReplies
from worker.speculation import SpeculationSettings
from worker.stream import Send, Stream, open_stream

log = logging.getLogger("lmserve.worker")


@dataclass
class SchedulerSettings:
    ctx: int = 4096  # per-request budget: a cartridge's positions, prompt and completion
    queue: int = DEFAULT_QUEUE  # waiting requests beyond which new ones get BUSY
    batch: int = 1  # streams decoded together
    kv_slots: int = 1  # resident caches asked for (see slot_count)
    kv_budget: int = 0  # positions all caches hold together before idle ones go (0: no limit)
    prefill_chunk: int = 256  # prompt tokens per step while others decode
    threads: int | None = None  # kernel threads of the engine thread (None: every core)
    scripted_replies: ScriptedReplies | None = None  # tests only: replay given tokens (worker/scripted.py)
    cartridge: Cartridge | None = None  # a KV prefix before every conversation (worker/cartridges/)
    library: list[Cartridge] = field(default_factory=list)  # more that requests may name instead
    fleet: Fleet | None = None  # cartridges chosen per conversation (worker/cartridges/fleet.py)
    speculation: SpeculationSettings | None = None  # drafts verified per pass (worker/speculation.py)

    @property
    def slot_count(self) -> int:
        return resident_slot_count(self.kv_slots, self.batch)


class Scheduler:
    def __init__(self, engine: Engine, settings: SchedulerSettings, send: Send,
                 spiller: KVSpiller | None = None, grammar: GrammarEngine | None = None,
                 cartridges: CartridgeChoice | None = None):
        self.engine = engine
        self.settings = settings
        self.send = send
        self.spiller = spiller
        self.grammar = grammar
        self.cartridges = cartridges or CartridgeChoice(engine, settings.cartridge, settings.library, settings.fleet)
        self.decoding = Decoding(engine.model, grammar, settings.ctx, send, self.finish, settings.speculation)
        self.blocks = BlockWriting(self.decoding) if engine.model.diffusion else None
        # requests whose grammar finished compiling, to be admitted by the IO thread
        self.compiled: deque[tuple[bytes, Stream, Any]] = deque()
        self.wake_io: Callable[[], None] = lambda: None  # set by the server
        self.between_steps: Callable[[], None] = lambda: None  # the server's engine-thread work (embeddings)
        self.pool = SlotPool(engine.model, settings.slot_count, settings.ctx, settings.kv_budget)
        if spiller is not None:  # a slot's sliding layers keep what the kvstore has not taken yet
            for slot in self.pool.slots:
                slot.cache.spilled = 0
        self.lock = threading.Lock()  # guards waiting, running and streams
        self.retrieving: deque[tuple[bytes, Stream]] = deque()  # streams a fleet chooses for
        self.wakeup = threading.Event()
        self.waiting: deque[Stream] = deque()
        self.running: list[Stream] = []
        self.streams: dict[tuple[bytes, str], Stream] = {}
        self.stopping = False
        self.steps = 0  # forward passes run, for tests and stats
        metrics.watch_scheduler(lambda: len(self.waiting), lambda: len(self.running),
                                lambda: sum(slot.cache.length > 0 for slot in self.pool.slots), len(self.pool.slots))

    # --- called from the IO thread --------------------------------------------------------------

    def submit(self, gateway: bytes, request: Generate) -> None:
        """Answer ACCEPTED, BUSY or REJECTED at once; accepted streams join the queue."""
        rid = request.request_id
        try:
            stream = open_stream(gateway, request, self.engine, self.settings.ctx, self.cartridges,
                                 self.grammar is not None, self.settings.scripted_replies)
        except InvalidRequestError as exc:
            self.send(gateway, Rejected(rid, exc.status, exc.kind, exc.message))
            return
        except Exception as exc:  # a request must never take the IO thread down with it
            log.exception("could not admit %s", rid)
            self.send(gateway, Rejected(rid, 400, InvalidRequestError.kind, f"the request could not be admitted: {exc}"))
            return
        if request.grammar is not None:
            # compile off the IO thread; the IO thread admits it when done (admit_compiled)
            self.grammar.compile_matcher(request.grammar).add_done_callback(
                lambda done: self._on_compiled(gateway, stream, done))
            return
        self._route(gateway, stream)

    def _route(self, gateway: bytes, stream: Stream) -> None:
        """Queue a valid stream; one whose cartridges a fleet chooses goes to the engine thread
        first, which embeds its message (a forward pass belongs on that thread)."""
        if not stream.retrieve:
            return self._enqueue(gateway, stream)
        self.retrieving.append((gateway, stream))
        self.wakeup.set()

    def _on_compiled(self, gateway: bytes, stream: Stream, future) -> None:
        self.compiled.append((gateway, stream, future))
        self.wake_io()

    def admit_compiled(self) -> None:
        """IO thread: answer the requests whose grammar compiled (or failed to)."""
        while self.compiled:
            gateway, stream, future = self.compiled.popleft()
            rid = stream.request.request_id
            try:
                stream.matcher = future.result()
            except InvalidRequestError as exc:
                self.send(gateway, Rejected(rid, exc.status, exc.kind, exc.message))
                continue
            except Exception as exc:
                log.exception("compiling the grammar of %s failed", rid)
                self.send(gateway, Rejected(rid, 400, InvalidRequestError.kind, f"the grammar could not be compiled: {exc}"))
                continue
            stream.grammar_active = not stream.request.grammar_after_reasoning
            self._route(gateway, stream)

    def _enqueue(self, gateway: bytes, stream: Stream) -> None:
        rid = stream.request.request_id
        with self.lock:
            if stream.key in self.streams:
                self.send(gateway, Rejected(rid, 400, InvalidRequestError.kind,
                                            f"request id {rid!r} is already in flight"))
                return
            # streams that would have to wait, this one included, once the free batch places fill
            would_wait = len(self.waiting) + 1 - max(0, self.settings.batch - len(self.running))
            if would_wait > self.settings.queue:
                self.send(gateway, Busy(rid, 1.0, f"the worker's queue is full "
                                                  f"({len(self.waiting)} waiting, --queue {self.settings.queue})"))
                return
            self.send(gateway, Accepted(rid, len(self.waiting),
                                        stream.cartridge.names if stream.cartridge is not None else []))
            self.streams[stream.key] = stream
            self.waiting.append(stream)
        self.wakeup.set()

    def abort(self, gateway: bytes, request_id: str, why: str = "its gateway asked") -> None:
        """End a stream; its FINISHED (reason abort) carries ``why`` as its error text, so a
        gateway that did not ask can say why its reply was cut."""
        with self.lock:
            stream = self.streams.get((gateway, request_id))
            if stream is None:
                return
            if stream in self.waiting:  # never started: finish it here, ahead of the queue
                self.waiting.remove(stream)
                del self.streams[stream.key]
                self.send(gateway, Finished(request_id, FinishReason.ABORT,
                                            len(stream.request.prompt), 0, 0, why))
                return
            stream.aborted = why
        self.wakeup.set()

    def abort_gateway(self, gateway: bytes, why: str) -> int:
        """A gateway went silent: end everything it asked for. Returns how many streams."""
        with self.lock:
            keys = [k for k in self.streams if k[0] == gateway]
        for _, request_id in keys:
            self.abort(gateway, request_id, why)
        return len(keys)

    def load(self) -> tuple[int, int]:
        with self.lock:
            return len(self.waiting), len(self.running)

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()

    def spill_resident(self) -> None:
        if self.spiller is not None:
            self.spiller.spill_idle(self.pool.slots)

    # --- the engine thread ------------------------------------------------------------------------

    def run(self) -> None:
        kernels.set_threads(self.settings.threads)  # numba's thread count is per calling thread
        while not self.stopping:
            self.choose_cartridges()
            self.between_steps()
            self.admit()
            if not self.running:
                self.wakeup.wait(0.05)
                self.wakeup.clear()
                continue
            try:
                self.step()
            except Exception:  # a fault no stream's own guard caught: its step's streams end, the loop goes on
                log.exception("a step failed; ending the %d running stream(s)", len(self.running))
                for stream in list(self.running):
                    self.finish(stream, FinishReason.ERROR, "the engine failed on this step")

    def choose_cartridges(self) -> None:
        """Engine thread: the fleet's choice for each stream waiting on one, then its queueing."""
        while self.retrieving:
            gateway, stream = self.retrieving.popleft()
            try:
                stream.cartridge = self.cartridges.chosen(stream.request)
            except Exception as exc:
                log.exception("choosing the cartridges of %s failed", stream.request.request_id)
                self.send(gateway, Rejected(stream.request.request_id, 500, LmserveError.kind,
                                            f"the fleet could not choose this conversation's cartridges: {exc}"))
                continue
            stream.retrieve = False
            self._enqueue(gateway, stream)

    def admit(self) -> None:
        """Move waiting streams into free batch places, each onto the KV slot that holds most of
        its prompt (restored from the kvstore where it has more)."""
        while True:
            with self.lock:
                if not self.waiting or len(self.running) >= self.settings.batch:
                    return
                stream = self.waiting[0]
                # a prompt to score is computed whole: it takes the least recently used slot
                floor = len(stream.held) if stream.scores is not None else stream.prefix
                choice = self.pool.acquire(stream.held, stream.request.cache_hint, floor, stream.request.namespace)
                if choice is None:
                    return
                self.waiting.popleft()
                stream.slot = choice.slot
            # restoring reads the kvstore: done outside the lock so admission answers never wait
            cache = stream.slot.cache
            cached = stream.behind_prefix(choice.reused_tokens)
            if stream.scores is not None:  # every prompt position's logits are needed: compute all
                cached = 0
                cache.truncate(0)
            elif self.spiller is not None:
                try:
                    cached = self.spiller.restore(cache, stream.held, cached, stream.slot.namespace)
                except Exception:
                    log.exception("restoring KV for %s failed; computing it instead", stream.request.request_id)
                    cached = stream.behind_prefix(cache.length)  # what is still valid of what it held
            if self.spiller is not None and not cache.rewindable:
                cache.snapshot_every = self.spiller.chunk_tokens
            stream.cached = cached - stream.prefix  # of the conversation's own tokens
            stream.pending = list(stream.held[cached:])
            cache.resumable_at = len(stream.held) - 1  # the next turn goes on from this prompt
            cache.prompt_end = len(stream.held)
            cache.reserve(len(stream.pending))  # grown once, not chunk by chunk
            with self.lock:
                self.running.append(stream)

    def step(self) -> None:
        """One weight pass for every running stream: a token each for decoding streams, a prompt
        chunk for the others; then sample and send what it produced."""
        for stream in [s for s in self.running if s.aborted is not None]:
            self.finish(stream, FinishReason.ABORT, stream.aborted)
        batch: list[tuple[Stream, list[int]]] = []
        prefill_budget = self.settings.prefill_chunk
        for stream in self.running:
            if stream.pending and prefill_budget > 0:
                every, length = stream.slot.cache.snapshot_every, stream.slot.cache.length
                # recurrent state is kept at chunk ends: a step stops at the next one
                chunk = stream.pending[:min(prefill_budget, every - length % every) if every else prefill_budget]
                prefill_budget -= len(chunk)
                batch.append((stream, chunk))
            elif not stream.pending and stream.next_token is not None:
                batch.append((stream, self.decoding.feed(stream)))
        denoising = [s for s in self.running if s.writer is not None and not s.pending]
        if not batch and not denoising:
            return
        started = time.perf_counter()
        failed = lambda s: self.finish(s, FinishReason.ERROR, "the engine failed on this request")  # noqa: E731
        # a prompt being scored needs the logits of all its rows: it goes through a pass of its own
        scored = [(s, toks) for s, toks in batch if s.scores is not None and s.pending]
        plain = [(s, toks) for s, toks in batch if not (s.scores is not None and s.pending)]
        tails, readers, best = self.decoding.passing(plain)  # drafts to verify, drafters reading the states
        by_stream = dict(zip((id(s) for s, _ in plain),
                             passes.forward(self.engine.model, plain, failed, tails, readers, best) if plain else []))
        for stream, tokens in scored:
            by_stream[id(stream)] = passes.score(self.engine.model, stream, tokens, failed)
        denoised = self.blocks.denoise(denoising) if denoising else []
        metrics.STEP.observe(time.perf_counter() - started)
        metrics.BATCH.observe(len(batch) + len(denoising))
        for stream, tokens in batch:
            metrics.STEP_TOKENS.labels("prefill" if stream.pending else "decode").inc(len(tokens))
        self.steps += 1
        sampled = [(s, by_stream[id(s)]) for s, tokens in batch if self._read(s, tokens, by_stream[id(s)])]
        for stream, logits in zip(denoising, denoised):
            if logits is not None:  # None: already finished with an error
                self.blocks.take(stream, logits)
        if self.blocks is not None:  # a prompt or block was read: the next block starts
            for stream, _ in sampled:
                self.blocks.start_block(stream)
            return
        self.decoding.advance(sampled)

    def _read(self, stream: Stream, tokens: list[int], logits) -> bool:
        """Account for the tokens a stream's pass read; whether its logits go on to sampling."""
        if logits is None:
            return False  # already finished with an error
        if stream.pending:
            del stream.pending[:len(tokens)]
            if self.spiller is not None:
                self.spiller.spill_filled(stream.slot.cache, stream.slot.namespace, len(tokens), stream.request.request_id)
            if stream.pending:
                return False  # more prompt to read before the first token
        elif stream.slot.cache.snapshots and self.spiller is not None:
            # a reply reached a chunk's end: its states go with the chunk
            self.spiller.spill_logged(stream.slot.cache, stream.slot.namespace, stream.request.request_id)
        if stream.scores is not None:
            self.send(stream.gateway, Tokens(stream.request.request_id, [], cached_tokens=0,
                                             prompt_logprobs=stream.scores))
            stream.scores = None
            if stream.request.max_tokens == 0:
                self.finish(stream, FinishReason.LENGTH)
                return False
        return True

    def finish(self, stream: Stream, reason: FinishReason, error: str | None = None) -> None:
        """End a stream: out of the batch, its slot given back (its KV spilled), FINISHED sent."""
        with self.lock:
            if stream in self.running:
                self.running.remove(stream)
            self.streams.pop(stream.key, None)
        stream.done = True
        if stream.slot is not None:
            self.pool.release(stream.slot)
            if self.spiller is not None and reason != FinishReason.ERROR:
                self.spiller.spill_logged(stream.slot.cache, stream.slot.namespace, stream.request.request_id)
        self.send(stream.gateway, stream.finished(reason, error))
