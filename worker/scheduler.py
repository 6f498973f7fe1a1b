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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.errors import InvalidRequestError, LmserveError
from shared.prefix_digest import prefix_digests
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
from worker import metrics
from worker.engine import kernels
from worker.engine import Engine
from worker.cartridge import Cartridge, compose
from worker.diffusion import CanvasWriter
from worker.fleet import Fleet
from worker.engine.sampling import Sampler
from worker.grammar import GrammarEngine, error_text
from worker.kv_slots import Slot, SlotPool
from worker.kv_spill import KVSpiller
from worker.scripted import ScriptedReplies

SLOW_MASKS = 1.0  # seconds: a step whose grammar masks take longer is logged with its streams
log = logging.getLogger("lmserve.worker")

Sender = Callable[[bytes, Message], None]


MAX_COMPOSITIONS = 16  # compositions of named cartridges kept made
MAX_PROMPT_ALTERNATIVES = 20  # alternatives per scored prompt token, as for generated ones


def resident_slot_count(kv_slots: int, batch: int) -> int:
    """Resident KV caches: --kv-slots, raised to --batch, since every stream of a batch holds one."""
    return max(kv_slots, batch)


@dataclass
class SchedulerSettings:
    ctx: int = 4096  # per-request budget: a cartridge's positions, prompt and completion
    queue: int = 16  # waiting requests beyond which new ones get BUSY
    batch: int = 1  # streams decoded together
    kv_slots: int = 1  # resident caches asked for (see slot_count)
    prefill_chunk: int = 256  # prompt tokens per step while others decode
    threads: int | None = None  # kernel threads of the engine thread (None: every core)
    scripted_replies: ScriptedReplies | None = None  # tests only: replay given tokens (worker/scripted.py)
    cartridge: Cartridge | None = None  # a KV prefix before every conversation (worker/cartridge.py)
    library: list[Cartridge] = field(default_factory=list)  # more that requests may name instead
    fleet: Fleet | None = None  # cartridges chosen per conversation (worker/fleet.py)

    @property
    def prefix(self) -> int:
        """Cache positions the default cartridge (or a fleet's largest choice) takes before each
        conversation's own."""
        if self.fleet is not None:
            return self.fleet.prefix_tokens
        return self.cartridge.tokens if self.cartridge is not None else 0

    @property
    def cartridges(self) -> dict[str, Cartridge]:
        """Every cartridge a request may name, by name: the default first, a fleet's last."""
        fleet = list(self.fleet.cartridges.values()) if self.fleet is not None else []
        return {c.name: c for c in ([self.cartridge] if self.cartridge is not None else []) + self.library + fleet}

    @property
    def slot_count(self) -> int:
        return resident_slot_count(self.kv_slots, self.batch)


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
    aborted: str | None = None  # why the stream was aborted, once it is
    matcher: Any = None  # an llguidance matcher when the request carries a grammar
    grammar_active: bool = False  # False while a reasoning block must end first
    # with prompt_logprobs: each prompt token's [logprob, alternatives] so far (None: not asked)
    scores: list[list[Any]] | None = None
    cartridge: Cartridge | None = None  # the KV prefix it is served behind
    retrieve: bool = False  # a fleet chooses its cartridge before it is queued
    # on a text-diffusion model: the block being denoised (None while a prompt or block is read)
    writer: CanvasWriter | None = None
    rng: np.random.Generator | None = None  # a text-diffusion stream's canvases and draws

    @property
    def prefix(self) -> int:
        return self.cartridge.tokens if self.cartridge is not None else 0

    @property
    def key(self) -> tuple[bytes, str]:
        return self.gateway, self.request.request_id


class Scheduler:
    def __init__(self, engine: Engine, settings: SchedulerSettings, send: Sender,
                 spiller: KVSpiller | None = None, grammar: GrammarEngine | None = None):
        self.engine = engine
        self.settings = settings
        self.send = send
        self.spiller = spiller
        self.grammar = grammar
        # requests whose grammar finished compiling, to be admitted by the IO thread
        self.compiled: deque[tuple[bytes, Stream, Any]] = deque()
        self.wake_io: Callable[[], None] = lambda: None  # set by the server
        self.pool = SlotPool(engine.model, settings.slot_count, settings.ctx)
        if spiller is not None:  # a slot's sliding layers keep what the kvstore has not taken yet
            for slot in self.pool.slots:
                slot.cache.spilled = 0
        self.lock = threading.Lock()
        self.compositions: dict[tuple[str, ...], Cartridge] = {}  # cartridges composed for requests
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
            stream = self._validate(gateway, request)
        except InvalidRequestError as exc:
            self.send(gateway, Rejected(rid, exc.status, exc.kind, exc.message))
            return
        except Exception as exc:  # a request must never take the IO thread down with it
            log.exception("could not admit %s", rid)
            self.send(gateway, Rejected(rid, 400, InvalidRequestError.kind, f"the request could not be admitted: {exc}"))
            return
        if request.grammar is not None:
            # compile off the IO thread; the IO thread admits it when done (admit_compiled)
            future = self.grammar.compile_matcher(request.grammar)
            future.add_done_callback(lambda done: self._on_compiled(gateway, stream, done))
            return
        self._route(gateway, stream)

    def _route(self, gateway: bytes, stream: Stream) -> None:
        """Queue a valid stream; one whose cartridges a fleet chooses goes to the engine thread
        first, which embeds its message (a forward pass belongs on that thread)."""
        if stream.retrieve:
            self.retrieving.append((gateway, stream))
            self.wakeup.set()
            return
        self._enqueue(gateway, stream)

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

    def resident_digests(self) -> list[bytes]:
        """What the resident slots hold, as the prefix digests gateways route by (conversation
        tokens only: a cartridge's pseudo-ids, alike in every slot, are left out)."""
        held: dict[bytes, None] = {}
        for slot in self.pool.slots:
            tokens = slot.cache.tokens[:]  # a copy, taken whole while the engine thread works on
            skip = next((i for i, t in enumerate(tokens) if t >= 0), len(tokens))  # pseudo-ids lead
            held.update(dict.fromkeys(prefix_digests(tokens[skip:])))
        return list(held)

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()

    def spill_resident(self) -> None:
        """On shutdown: keep what every idle slot holds, so a restarted worker can restore it."""
        if self.spiller is None:
            return
        for slot in self.pool.slots:
            if not slot.busy and slot.cache.length:
                self.spiller.spill(slot.cache, slot.namespace)
        self.spiller.close()

    def _validate(self, gateway: bytes, request: Generate) -> Stream:
        prompt = request.prompt
        n_vocab = self.engine.model.hp.n_vocab
        if not prompt:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        ids = np.asarray(prompt)
        if ids.min() < 0 or ids.max() >= n_vocab:
            raise InvalidRequestError(f"prompt token ids must lie in 0..{n_vocab - 1}")
        if not -1 <= request.prompt_logprobs <= MAX_PROMPT_ALTERNATIVES:
            raise InvalidRequestError(f"prompt_logprobs must lie in 0..{MAX_PROMPT_ALTERNATIVES} (or -1: none)")
        if self.engine.model.diffusion:
            self._check_diffusion(request)
        # a prompt may be scored and nothing generated (how evaluation harnesses score text)
        if request.max_tokens < (0 if request.prompt_logprobs >= 0 else 1):
            raise InvalidRequestError("max_tokens must be at least 1")
        cartridge = self._cartridge_of(request)
        retrieve = cartridge is None and not request.cartridge_ids and self.settings.fleet is not None
        # a fleet's choice is made later, on the engine thread: its largest is what must fit
        prefix = cartridge.tokens if cartridge is not None else self.settings.prefix if retrieve else 0
        room = self.settings.ctx - prefix
        if len(prompt) >= room:
            held = f", {prefix} of them the cartridge's" if prefix else ""
            raise InvalidRequestError(
                f"prompt is too long: {len(prompt)} tokens > {room - 1} maximum "
                f"(the context budget --ctx is {self.settings.ctx} tokens{held}, prompt and completion together)")
        if (cartridge is not None or retrieve) and request.prompt_logprobs >= 0:
            raise InvalidRequestError("a prompt is not scored behind a cartridge (prompt_logprobs)")
        if request.grammar is not None and self.grammar is None:
            raise InvalidRequestError("constrained decoding (grammar) is not available in this worker")
        params = request.sampling
        stop_ids = set(request.stop_ids) if request.stop_ids is not None else set(self.engine.tokenizer.stop_ids)
        script = self.settings.scripted_replies
        sampler = script.sampler(params, prompt) if script is not None else Sampler(params, prompt)
        return Stream(gateway, request, params, sampler, stop_ids,
                      scores=[[None, []]] if request.prompt_logprobs >= 0 else None, cartridge=cartridge,
                      retrieve=retrieve, rng=CanvasWriter.rng_for(params) if self.engine.model.diffusion else None)

    @staticmethod
    def _check_diffusion(request: Generate) -> None:
        """What a text-diffusion model cannot do: its tokens are not drawn one by one from a
        next-token distribution, so there is nothing to constrain token by token or to report
        log-probabilities of."""
        params = request.sampling
        unsupported = [what for what, asked in (
            ("constrained output (a grammar, JSON schema or forced tool call)", request.grammar is not None),
            ("log-probabilities", params.logprobs or params.top_logprobs > 0 or request.prompt_logprobs >= 0),
            ("cartridges", bool(request.cartridge_ids))) if asked]
        if unsupported:
            raise InvalidRequestError(f"this model writes its replies a block at a time (text diffusion): "
                                      f"{', '.join(unsupported)} cannot be served on it")

    def _cartridge_of(self, request: Generate) -> Cartridge | None:
        """The cartridges a request names (by name or id), composed in its order, else the
        default one; None too where a fleet will choose (its query checked here)."""
        fleet = self.settings.fleet
        if not request.cartridge_ids and fleet is not None:
            query = request.query
            if not isinstance(query, list) or not all(isinstance(t, int) and 0 <= t < fleet.vocab for t in query):
                raise InvalidRequestError(f"query must be token ids in 0..{fleet.vocab - 1}")
            if request.conversation is not None and not isinstance(request.conversation, str):
                raise InvalidRequestError("conversation must be a string")
            return None  # chosen on the engine thread (choose_cartridges)
        if not request.cartridge_ids:
            return self.settings.cartridge
        available = self.settings.cartridges
        parts = []
        for name in request.cartridge_ids:
            found = next((c for c in available.values() if name in (c.name, c.cartridge_id)), None)
            if found is None:
                raise InvalidRequestError(f"unknown cartridge {name!r}: this worker serves "
                                          f"{', '.join(map(repr, available)) or 'none'} (--cartridge, --cartridges)",
                                          param="cartridges")
            if found in parts:
                raise InvalidRequestError(f"cartridge {name!r} is named twice", param="cartridges")
            parts.append(found)
        return self.composed(parts)

    def composed(self, parts: list[Cartridge]) -> Cartridge:
        """The composition of these parts in this order, made once and kept (a few of them)."""
        key = tuple(p.cartridge_id for p in parts)
        with self.lock:
            made = self.compositions.pop(key, None)
        if made is None:
            made = compose(parts, self.engine)
        with self.lock:
            self.compositions[key] = made  # most recently used last
            while len(self.compositions) > MAX_COMPOSITIONS:
                del self.compositions[next(iter(self.compositions))]
        return made

    # --- the engine thread ------------------------------------------------------------------------

    def run(self) -> None:
        kernels.set_threads(self.settings.threads)  # numba's thread count is per calling thread
        while not self.stopping:
            self.choose_cartridges()
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
                    self._finish(stream, FinishReason.ERROR, "the engine failed on this step")

    def choose_cartridges(self) -> None:
        """Engine thread: the fleet's choice for each stream waiting on one, then its queueing."""
        fleet = self.settings.fleet
        while self.retrieving:
            gateway, stream = self.retrieving.popleft()
            request = stream.request
            try:
                # a tenant's conversations are its own: another's session id recalls none of its choices
                conversation = request.conversation and "\0".join(filter(None, (request.namespace,
                                                                                 request.conversation)))
                names = fleet.choose(conversation, request.query)
                stream.cartridge = self.composed([fleet.cartridges[n] for n in names])
            except Exception as exc:
                log.exception("choosing the cartridges of %s failed", request.request_id)
                self.send(gateway, Rejected(request.request_id, 500, LmserveError.kind,
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
                held = self._held(stream)
                # a prompt to score is computed whole: it takes the least recently used slot
                floor = len(held) if stream.scores is not None else stream.prefix
                choice = self.pool.acquire(held, stream.request.cache_hint, floor, stream.request.namespace)
                if choice is None:
                    return
                self.waiting.popleft()
                stream.slot = choice.slot
            # restoring reads the kvstore: done outside the lock so admission answers never wait
            cached = choice.reused_tokens
            held = self._held(stream)
            cartridge = stream.cartridge
            if cartridge is not None and cached < cartridge.tokens:
                cartridge.put_into(stream.slot.cache)  # a slot without the prefix gets it first
                cached = cartridge.tokens
            if stream.scores is not None:  # every prompt position's logits are needed: compute all
                cached = 0
                stream.slot.cache.truncate(0)
            elif self.spiller is not None:
                try:
                    cached = self.spiller.restore(stream.slot.cache, held, cached, stream.slot.namespace)
                except Exception:
                    log.exception("restoring KV for %s failed; computing it instead", stream.request.request_id)
                    cached = stream.slot.cache.length  # what is still valid of what it held
                    if cartridge is not None and cached < cartridge.tokens:
                        cartridge.put_into(stream.slot.cache)
                        cached = cartridge.tokens
            if self.spiller is not None and not stream.slot.cache.rewindable:
                stream.slot.cache.snapshot_every = self.spiller.chunk_tokens
            stream.cached = cached - stream.prefix  # of the conversation's own tokens
            stream.pending = list(held[cached:])
            stream.slot.cache.reserve(len(stream.pending))  # grown once, not chunk by chunk
            with self.lock:
                self.running.append(stream)

    def _held(self, stream: Stream) -> list[int]:
        """The tokens a stream's cache holds once its prompt is read: the cartridge's pseudo-ids
        (if any), then the prompt."""
        cartridge = stream.cartridge
        prompt = stream.request.prompt
        return prompt if cartridge is None else cartridge.pseudo_ids + list(prompt)

    def step(self) -> None:
        """One weight pass for every running stream: a token each for decoding streams, a prompt
        chunk for the others; then sample and send what it produced."""
        for stream in [s for s in self.running if s.aborted is not None]:
            self._finish(stream, FinishReason.ABORT, stream.aborted)
        batch: list[tuple[Stream, list[int]]] = []
        prefill_budget = self.settings.prefill_chunk
        for stream in self.running:
            if stream.pending:
                if prefill_budget <= 0:
                    continue
                take = prefill_budget
                every = stream.slot.cache.snapshot_every
                if every:  # recurrent state is kept at chunk ends: a step stops at the next one
                    take = min(take, every - stream.slot.cache.length % every)
                chunk = stream.pending[:take]
                prefill_budget -= len(chunk)
                batch.append((stream, chunk))
            elif stream.next_token is not None:
                batch.append((stream, [stream.next_token]))
        denoising = [s for s in self.running if s.writer is not None and not s.pending]
        if not batch and not denoising:
            return
        started = time.perf_counter()
        # a prompt being scored needs the logits of all its rows: it goes through a pass of its own
        scored = [(s, toks) for s, toks in batch if s.scores is not None and s.pending]
        plain = [(s, toks) for s, toks in batch if not (s.scores is not None and s.pending)]
        by_stream = dict(zip((id(s) for s, _ in plain), self._forward(plain) if plain else []))
        for stream, tokens in scored:
            by_stream[id(stream)] = self._score(stream, tokens)
        results = [by_stream[id(s)] for s, _ in batch]
        denoised = self._denoise(denoising) if denoising else []
        metrics.STEP.observe(time.perf_counter() - started)
        metrics.BATCH.observe(len(batch) + len(denoising))
        for stream, tokens in batch:
            metrics.STEP_TOKENS.labels("prefill" if stream.pending else "decode").inc(len(tokens))
        self.steps += 1
        sampling: list[tuple[Stream, np.ndarray]] = []
        for (stream, tokens), logits in zip(batch, results):
            if logits is None:
                continue  # already finished with an error
            if stream.pending:
                del stream.pending[:len(tokens)]
                self._spill_filled(stream, len(tokens))
                if stream.pending:
                    continue  # more prompt to read before the first token
            elif stream.slot.cache.snapshots and self.spiller is not None:
                self._spill(stream)  # a reply reached a chunk's end: its states go with the chunk
            if stream.scores is not None:
                self.send(stream.gateway, Tokens(stream.request.request_id, [], cached_tokens=0,
                                                 prompt_logprobs=stream.scores))
                stream.scores = None
                if stream.request.max_tokens == 0:
                    self._finish(stream, FinishReason.LENGTH)
                    continue
            sampling.append((stream, logits))
        for stream, logits in zip(denoising, denoised):
            if logits is None:
                continue  # already finished with an error
            try:
                stream.writer.advance(logits)
                if stream.writer.done:
                    self._write_block(stream)
            except Exception as exc:
                log.exception("writing a block failed for %s", stream.request.request_id)
                self._finish(stream, FinishReason.ERROR, f"writing a block failed: {exc}")
        if self.engine.model.diffusion:  # a prompt or block was read: the next block starts
            for stream, _ in sampling:
                self._start_block(stream)
            return
        masks = self._masks([s for s, _ in sampling])
        for stream, logits in sampling:
            self._emit(stream, logits, masks.get(id(stream)))

    def _spill_filled(self, stream: Stream, added: int) -> None:
        """Queue the spill of the chunks a prompt step just filled (the rest goes at the end)."""
        if self.spiller is None:
            return
        chunk, length = self.spiller.chunk_tokens, stream.slot.cache.length
        if length // chunk > (length - added) // chunk:
            self._spill(stream)

    def _spill(self, stream: Stream) -> None:
        try:
            self.spiller.spill(stream.slot.cache, stream.slot.namespace)
        except Exception:
            log.exception("spilling KV of %s failed", stream.request.request_id)

    def _masks(self, streams: list[Stream]) -> dict[int, np.ndarray]:
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
                self._finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {exc}")
        return masks

    def _forward(self, batch: list[tuple[Stream, list[int]]]) -> list[np.ndarray | None]:
        """One weight pass for the batch; if it fails, retry each stream alone so only the
        stream at fault ends (its cache writes past ``length`` were never committed, and the
        recurrent states a failed pass moved on are put back)."""
        # recurrent states are updated in place, layer by layer: kept to retry from
        kept = {id(s): s.slot.cache.copy_recurrent() for s, _ in batch if s.slot.cache.recurrent} \
            if len(batch) > 1 else {}
        try:
            return self.engine.model.forward([(s.slot.cache, toks) for s, toks in batch])
        except Exception:
            if len(batch) == 1:
                log.exception("forward pass failed for %s", batch[0][0].request.request_id)
                self._finish(batch[0][0], FinishReason.ERROR, "the engine failed on this request")
                return [None]
        for stream, _ in batch:
            if id(stream) in kept:
                stream.slot.cache.recurrent = kept[id(stream)]
            elif not stream.slot.cache.rewindable:
                stream.slot.cache.recurrent.clear()  # states the failed pass began from nothing
        results: list[np.ndarray | None] = []
        for stream, tokens in batch:
            try:
                results.append(self.engine.model.forward([(stream.slot.cache, tokens)])[0])
            except Exception:
                log.exception("forward pass failed for %s", stream.request.request_id)
                self._finish(stream, FinishReason.ERROR, "the engine failed on this request")
                results.append(None)
        return results

    def _denoise(self, streams: list[Stream]) -> list[np.ndarray | None]:
        """One denoising pass for every block being written, in one weight pass; if it fails,
        each alone, so only the stream at fault ends."""
        model = self.engine.model

        def canvases(group: list[Stream]) -> list:
            return [(s.slot.cache, s.writer.canvas.tolist(), s.writer.probs) for s in group]

        try:
            return model.denoise(canvases(streams))
        except Exception:
            log.exception("denoising pass failed for %d stream(s)", len(streams))
        results: list[np.ndarray | None] = []
        for stream in streams:
            try:
                results.append(model.denoise(canvases([stream]))[0])
            except Exception:
                log.exception("denoising pass failed for %s", stream.request.request_id)
                self._finish(stream, FinishReason.ERROR, "the engine failed on this request")
                results.append(None)
        return results

    def _start_block(self, stream: Stream) -> None:
        """A text-diffusion stream has read its prompt or its last block: a new canvas, as long
        as the context has room for one (a shorter one where it has less)."""
        if stream not in self.running:
            return
        room = self.settings.ctx - (stream.prefix + len(stream.request.prompt) + stream.completion)
        model = self.engine.model
        length = min(model.settings.canvas_length, room)
        if length <= 0:
            self._finish(stream, FinishReason.CONTEXT)
            return
        stream.writer = CanvasWriter(model.settings, model.hp.n_vocab, length, stream.params, stream.rng)

    def _write_block(self, stream: Stream) -> None:
        """Send a finished block, cut after its first end-of-turn token or at max_tokens; the
        reply ends there, or the block is read into the cache before the next one starts."""
        request, block = stream.request, stream.writer.written()
        stream.writer = None
        kept = block[:request.max_tokens - stream.completion]
        stop = next((i for i, token in enumerate(kept) if token in stream.stop_ids), None)
        if stop is not None:
            kept = kept[:stop + 1]
        stream.completion += len(kept)
        first = stream.completion == len(kept)
        self.send(stream.gateway, Tokens(request.request_id, kept, cached_tokens=stream.cached if first else None))
        metrics.STEP_TOKENS.labels("decode").inc(len(kept))
        if not self._ended(stream, stop is not None):
            stream.pending = list(kept)  # the encoder reads the block, then the next one starts

    def _score(self, stream: Stream, tokens: list[int]) -> np.ndarray | None:
        """A prompt chunk's pass with the logits of every row: each row scores the prompt token
        after it (its logprob and the best alternatives go to ``stream.scores``). Returns the
        last row's logits, which go on to the first generated token."""
        try:
            rows = self.engine.model.forward([(stream.slot.cache, tokens)], all_logits=True)[0]
        except Exception:
            log.exception("forward pass failed for %s", stream.request.request_id)
            self._finish(stream, FinishReason.ERROR, "the engine failed on this request")
            return None
        prompt, k = stream.request.prompt, stream.request.prompt_logprobs
        start = len(prompt) - len(stream.pending)  # the chunk's first position in the prompt
        for j in range(len(tokens)):
            target = start + j + 1
            if target >= len(prompt):
                break  # the last row predicts the first generated token, not a prompt one
            # one row at a time in float64: a chunk's whole [T, vocab] would be gigabytes
            wide = rows[j].astype(np.float64)
            peak = wide.max()
            row = wide - (peak + np.log(np.exp(wide - peak).sum()))
            top = np.argpartition(-row, k)[:k] if k else np.zeros(0, dtype=np.int64)
            top = top[np.argsort(-row[top], kind="stable")]
            stream.scores.append([float(row[prompt[target]]), [[int(i), float(row[i])] for i in top]])
        return rows[-1]

    def _emit(self, stream: Stream, logits: np.ndarray, allowed: np.ndarray | None = None) -> None:
        request = stream.request
        if stream not in self.running:
            return  # ended while its mask was computed
        if stream.matcher is not None and stream.grammar_active and stream.matcher.is_error():
            self._finish(stream, FinishReason.ERROR, f"the grammar matcher failed: {error_text(stream.matcher)}")
            return
        try:
            token = stream.sampler.sample(logits, allowed)
        except Exception as exc:
            log.exception("sampling failed for %s", request.request_id)
            self._finish(stream, FinishReason.ERROR, f"sampling failed: {exc}")
            return
        grammar_done = False
        if stream.matcher is not None and token.token_id not in stream.stop_ids:
            if stream.grammar_active:
                # A token the grammar refuses is never shown: the stream ends before it.
                if not stream.matcher.consume_token(token.token_id):
                    self._finish(stream, FinishReason.ERROR,
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
            [[[i, lp] for i, lp in token.top_logprobs]] if stream.params.top_logprobs else None,
            stream.cached if stream.completion == 1 else None))
        if not self._ended(stream, token.token_id in stream.stop_ids or grammar_done):
            stream.next_token = token.token_id

    def _ended(self, stream: Stream, stopped: bool) -> bool:
        """Finish a stream whose reply is over (it stopped, reached max_tokens or filled the
        context); whether it was."""
        request = stream.request
        if stopped:
            self._finish(stream, FinishReason.STOP)
        elif stream.completion >= request.max_tokens:
            self._finish(stream, FinishReason.LENGTH)
        elif stream.prefix + len(request.prompt) + stream.completion >= self.settings.ctx:
            self._finish(stream, FinishReason.CONTEXT)
        else:
            return False
        return True

    def _finish(self, stream: Stream, reason: FinishReason, error: str | None = None) -> None:
        with self.lock:
            if stream in self.running:
                self.running.remove(stream)
            self.streams.pop(stream.key, None)
        if stream.slot is not None:
            self.pool.release(stream.slot)
            if self.spiller is not None and reason != FinishReason.ERROR:
                self._spill(stream)
        self.send(stream.gateway, Finished(
            stream.request.request_id, reason, len(stream.request.prompt), stream.cached,
            stream.completion, error))
