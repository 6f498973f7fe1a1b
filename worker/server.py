"""The worker process: owns the engine, binds the ROUTER, runs the scheduler.

The main thread does all socket IO (ZeroMQ sockets are not thread-safe); the scheduler runs
the engine on its own thread (numpy's BLAS releases the GIL) and hands outgoing messages back
through an in-process PUSH/PULL pair, so a long forward pass never delays an ABORT, a
heartbeat or a BUSY answer. Embedding requests (worker/embeddings.py) run on the same engine
thread, between the scheduler's steps.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import zmq

from shared.chat_template import ChatTemplate, chat_template_from_metadata
from shared.protocol import (
    DEFAULT_ENDPOINT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    HELLO_FIRST,
    PROTOCOL_VERSION,
    VERSION_MISMATCH,
    Abort,
    Capabilities,
    Embed,
    Generate,
    Heartbeat,
    Hello,
    InvalidRequestMessage,
    Message,
    ModelCard,
    ProtocolError,
    Rejected,
    decode,
    version_mismatch_message,
)
from shared.conventions.registry import get as registered_convention
from shared.errors import InvalidRequestError
from shared.memory import give_back_freed_memory
from shared.sampling_params import SamplingDefaults
from shared.wire_security import ServerKeys, secure_server
from worker.capabilities import convention, has_reasoning_switch, tool_call_tags
from worker.embeddings import Embedder
from worker.engine import Engine
from worker.grammar import GrammarEngine
from worker.cartridges.choice import CartridgeChoice
from worker.kv_spill import KVSpiller
from worker.model_facts import model_facts, sampling_defaults
from worker.reasoning_budget import ReasoningMarkers
from worker.scheduler import Scheduler, SchedulerSettings

log = logging.getLogger("lmserve.worker")


@dataclass
class WorkerSettings:
    endpoint: str = DEFAULT_ENDPOINT
    scheduler: SchedulerSettings = None  # type: ignore[assignment]
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    spiller: KVSpiller | None = None
    chat_template: str | None = None  # --chat-template: replaces the file's own (or supplies one)
    wire: ServerKeys | None = None  # CURVE keys: the wire encrypted, answering only allowed gateways
    # --temperature, --top-p, --top-k, --min-p, --repeat-penalty: over the file's recommendation
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        if self.scheduler is None:
            self.scheduler = SchedulerSettings()


class WorkerServer:
    def __init__(self, engine: Engine, settings: WorkerSettings):
        self.engine = engine
        self.settings = settings
        self.context = zmq.Context.instance()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished peer drops its messages
        if settings.wire is not None:
            secure_server(self.router, settings.wire)
        self.router.bind(settings.endpoint)
        self.outbox_address = f"inproc://outbox-{id(self)}"
        self.outbox = self.context.socket(zmq.PULL)
        self.outbox.bind(self.outbox_address)
        self._thread_local = threading.local()
        self.instance = uuid.uuid4().hex
        sched = settings.scheduler
        self.cartridges = CartridgeChoice(engine, sched.cartridge, sched.library, sched.fleet)
        self.card = self._model_card()
        self.grammar = GrammarEngine(engine.tokenizer, engine.model.hp.n_vocab,
                                     reasoning_close=self.card.capabilities.reasoning_tags.close)
        self.scheduler = Scheduler(engine, settings.scheduler, self._send_from_any_thread, settings.spiller,
                                   self.grammar, self.cartridges)
        self.scheduler.wake_io = self._wake_io
        self.scheduler.decoding.reasoning = ReasoningMarkers.of(
            engine.tokenizer, registered_convention(self.card.capabilities.convention))
        self.embedder = Embedder(engine, sched.ctx, sched.queue, sched.prefill_chunk, self._send_from_any_thread,
                                 self.scheduler.wakeup.set)
        self.scheduler.between_steps = self._between_steps
        self._idle_since_step = 0  # the scheduler's step count when the engine last went idle
        self.gateways: dict[bytes, float] = {}  # identity -> last time heard from
        self.greeted: set[bytes] = set()  # gateways that said HELLO to this instance
        # The card is packed once (its tokenizer spec is megabytes), and a gateway gets it at most
        # once a heartbeat interval: a client that said HELLO every second while the worker was
        # not yet bound (loading, compiling kernels) has them all delivered at once, and packing
        # a card per HELLO held this thread, and every heartbeat, for seconds.
        self.card_frames = self.card.frames()
        self.carded: dict[bytes, float] = {}  # identity -> when its card went out
        self.stopping = threading.Event()

    def _between_steps(self) -> None:
        """Engine thread, between steps: pending embeddings; and once each time the scheduler
        runs out of work, the heap's free pages back to the system."""
        self.embedder.run_pending()
        scheduler = self.scheduler
        if scheduler.steps != self._idle_since_step and not scheduler.running and not scheduler.waiting:
            self._idle_since_step = scheduler.steps
            give_back_freed_memory()

    def _model_card(self) -> ModelCard:
        engine, sched = self.engine, self.settings.scheduler
        template = (ChatTemplate(self.settings.chat_template) if self.settings.chat_template
                    else chat_template_from_metadata(engine.metadata, engine.tokenizer))
        return ModelCard(
            version=PROTOCOL_VERSION, model_id=engine.model_id, architecture=engine.architecture,
            context_budget=sched.ctx - self.cartridges.prefix, n_vocab=engine.model.hp.n_vocab,
            tokenizer=engine.tokenizer.to_spec(),
            chat_template=template.source if template else None,
            fingerprint=engine.fingerprint, instance=self.instance, facts=model_facts(engine),
            sampling=self.settings.sampling.over(sampling_defaults(engine.metadata)),
            capabilities=Capabilities(
                context_length=engine.model.hp.context_length,
                reasoning_tags=convention(engine.tokenizer, template).reasoning,
                reasoning=has_reasoning_switch(engine.tokenizer, template),
                tool_call_tags=tool_call_tags(engine.tokenizer, template),
                convention=convention(engine.tokenizer, template).name,
                vision=False,  # no architecture here reads images
                grammar=True, batch=sched.batch, kv_slots=sched.slot_count, queue=sched.queue,
                kvstore=self.settings.spiller.store.describe() if self.settings.spiller else None,
                cartridges=list(self.cartridges.available),
                default_cartridge=sched.cartridge.name if sched.cartridge is not None else None,
                fleet=sched.fleet.names if sched.fleet is not None else [],
                worker=f"{socket.gethostname()}:{os.getpid()}"))

    # Messages from the IO thread go straight out; from any other thread, through the outbox.
    def _send_from_any_thread(self, identity: bytes, message: Message) -> None:
        if threading.current_thread() is threading.main_thread() or getattr(self._thread_local, "io", False):
            self.router.send_multipart([identity, *message.frames()])
            return
        self._push_socket().send_multipart([identity, *message.frames()])

    def _wake_io(self) -> None:
        """From another thread: have the IO thread look at the scheduler's compiled requests."""
        self._push_socket().send_multipart([b"", b"compiled"])

    def _push_socket(self) -> zmq.Socket:
        push = getattr(self._thread_local, "push", None)
        if push is None:
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.outbox_address)
            self._thread_local.push = push
        return push

    def serve_forever(self) -> None:
        """Answer gateways until ``stop`` (the engine warmed up already: ``Engine.warm_up``)."""
        self._thread_local.io = True
        engine_thread = threading.Thread(target=self.scheduler.run, name="engine", daemon=True)
        engine_thread.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        next_beat = time.monotonic()
        log.info("worker ready on %s (model %s)", self.settings.endpoint, self.engine.model_id)
        try:
            while not self.stopping.is_set():
                timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
                for sock, _ in poller.poll(timeout_ms):
                    if sock is self.outbox:
                        while True:
                            try:
                                frames = self.outbox.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if frames[0] == b"":  # a wake-up, not a message for a gateway
                                self.scheduler.admit_compiled()
                            else:
                                self.router.send_multipart(frames)
                    else:
                        while True:
                            try:
                                frames = self.router.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            try:
                                self._handle(frames[0], frames[1:])
                            except Exception:  # one bad message must not stop the worker
                                log.exception("handling a message from %r failed", frames[0])
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self.settings.heartbeat_interval
        finally:
            self.scheduler.stop()
            engine_thread.join(timeout=10)
            self.scheduler.spill_resident()
            self.router.close(0)
            self.outbox.close(0)

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            message = decode(frames)
        except InvalidRequestMessage as exc:  # a request after all: its gateway hears why it is refused
            self.gateways[identity] = time.monotonic()
            self.router.send_multipart([identity, *Rejected(exc.request_id, 400, InvalidRequestError.kind,
                                                            exc.message).frames()])
            return
        except ProtocolError as exc:
            log.warning("dropping a malformed message from %r: %s", identity, exc)
            return
        self.gateways[identity] = time.monotonic()
        if isinstance(message, Hello):
            if message.version != PROTOCOL_VERSION:
                self.router.send_multipart([identity, *Rejected(
                    "", 400, VERSION_MISMATCH,
                    version_mismatch_message(PROTOCOL_VERSION, message.version, "worker")).frames()])
                return
            self.greeted.add(identity)
            now = time.monotonic()
            if now - self.carded.get(identity, float("-inf")) < self.settings.heartbeat_interval:
                return  # a queued repeat: its card is on the way
            self.carded[identity] = now
            log.info("gateway %s connected", message.gateway or identity.hex())
            self.router.send_multipart([identity, *self.card_frames])
        elif isinstance(message, (Generate, Embed)):
            if identity not in self.greeted:
                self.router.send_multipart([identity, *Rejected(
                    message.request_id, 503, HELLO_FIRST,
                    "this worker has not been greeted by your gateway (it restarted); say HELLO first").frames()])
                return
            if isinstance(message, Generate):
                self.scheduler.submit(identity, message)
            else:
                self.embedder.submit(identity, message)
        elif isinstance(message, Abort):
            self.scheduler.abort(identity, message.request_id)
            self.embedder.abort(identity, message.request_id)
        elif isinstance(message, Heartbeat):
            pass  # being heard from is the whole point
        else:
            log.warning("ignoring %s from a gateway", type(message).__name__)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        waiting, running = self.scheduler.load()
        beat = Heartbeat(time.time(), self.instance, waiting, running, self.scheduler.pool.free_count(),
                         self.scheduler.pool.digests()).frames()
        for identity, last_seen in list(self.gateways.items()):
            if now - last_seen > self.settings.heartbeat_timeout:
                del self.gateways[identity]
                self.greeted.discard(identity)
                self.carded.pop(identity, None)
                why = (f"the worker heard nothing from this gateway for {self.settings.heartbeat_timeout:g} s "
                       "and ended its streams")
                ended = self.scheduler.abort_gateway(identity, why) + self.embedder.abort_gateway(identity, why)
                log.warning("gateway %s went silent; ended its %d request(s)", identity.hex(), ended)
                continue
            self.router.send_multipart([identity, *beat])

    def stop(self) -> None:
        self.stopping.set()
