"""The gateway's side of the wire: an asyncio client that hides ZeroMQ.

One ``WorkerClient`` per gateway process. It connects a DEALER to the worker, says HELLO,
keeps the MODEL_CARD, exchanges heartbeats, and routes each reply to the request it belongs
to. ``generate`` yields TOKENS and then the FINISHED message (for an EMBED, the EMBEDDINGS
message); leaving the loop early (client gone, stop string seen) sends ABORT. When the worker goes silent or restarts, every request in
flight fails with ``WorkerUnavailableError`` and the client says HELLO until a worker answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.flags import MAX_BUFFERED
from shared.errors import (
    BusyError,
    InvalidRequestError,
    LmserveError,
    WorkerUnavailableError,
)
from shared.protocol import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    HELLO_FIRST,
    PROTOCOL_VERSION,
    VERSION_MISMATCH,
    Abort,
    Accepted,
    Busy,
    Embed,
    Embeddings,
    Finished,
    Generate,
    Heartbeat,
    Hello,
    Message,
    ModelCard,
    MsgType,
    ProtocolError,
    Rejected,
    Tokens,
    decode,
    version_mismatch_message,
)
from shared.wire_security import ClientKeys, secure_client

log = logging.getLogger("lmserve.gateway")

FIRST_REPLY_TIMEOUT = 60.0
# After a refused key or CURVE on one side only, libzmq never connects again by itself: the client
# does, this often, so a worker restarted with the right keys is found.
REFUSED_RETRY = 2.0
# Handshakes dropped in a row before the client says the keys do not fit (libzmq retries every
# 100-250 ms here): one or two drops are a worker going down.
DROPPED_HANDSHAKES = 4


# The monitor events of a failed handshake (each event is one bit).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def refused_handshake(event: int, endpoint: str, wire: ClientKeys | None) -> str:
    """What to fix when the handshake with the worker failed with ``event``. Which event a
    mismatch raises varies from one connection to the next, so the advice rests on this
    gateway's own keys."""
    if wire is None:
        return (f"the handshake with the worker at {endpoint} failed: a worker with --wire-key answers only "
                "a gateway given --wire-key and --worker-key")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the worker at {endpoint} refused this gateway's key: list the gateway's public key in "
                "the worker's --wire-allow")
    return (f"the CURVE handshake with the worker at {endpoint} failed: the worker needs a --wire-key, and "
            "this gateway's --worker-key must be its public half")


# what a worker sends in answer to a request, routed to that request
REPLIES = (Accepted, Busy, Rejected, Tokens, Finished, Embeddings)


class WorkerClient:
    def __init__(self, endpoint: str, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT, name: str | None = None,
                 max_buffered: int = MAX_BUFFERED, wire: ClientKeys | None = None):
        self.endpoint = endpoint
        self.wire = wire  # CURVE keys: the wire encrypted, to a worker holding the expected key
        # Replies a request may hold unread before its reader is deemed hopelessly behind and
        # the request is cut off; the worker never waits for a slow reader.
        self.max_buffered = max_buffered
        self._cut: set[str] = set()
        self._accepted: set[str] = set()  # requests the current worker instance accepted
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.card: ModelCard | None = None
        self.version_error: str | None = None
        self.worker_load = (0, 0)  # waiting, running, from the last heartbeat
        self.free_slots = 0  # its KV slots no stream uses, from the last heartbeat
        self.prefixes: frozenset[bytes] = frozenset()  # what its slots hold (shared.prefix_digest)
        self._since_beat = 0  # this gateway's requests begun less those ended since the last heartbeat
        self._ready = asyncio.Event()
        self._pending: dict[str, asyncio.Queue[Message | LmserveError]] = {}
        self._last_heard = 0.0
        self._tasks: list[asyncio.Task] = []
        self._context = zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._counter = 0
        self._background: set[asyncio.Task] = set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def last_heard(self) -> float:
        """When (``time.monotonic``) the worker was last heard from: the clock of the silence
        check."""
        return self._last_heard

    @property
    def in_flight(self) -> int:
        """Requests of this gateway the worker has not finished."""
        return len(self._pending)

    @property
    def load(self) -> int:
        """Requests at the worker now, waiting or running: its last heartbeat's count, corrected
        by this gateway's own requests begun and ended since (a heartbeat is up to a second old)."""
        waiting, running = self.worker_load
        return max(waiting + running + self._since_beat, self.in_flight)

    def was_cut_off(self, request_id: str) -> bool:
        """Whether a request was dropped because its reader fell ``max_buffered`` replies behind."""
        return request_id in self._cut

    async def start(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        if self.wire is not None:
            secure_client(sock, self.wire)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 250)  # a worker that starts is found within a quarter second
        # A worker that dies (its connection drops) is given up at once, not after the heartbeat
        # timeout: its requests fail now, and a pool of workers resends the unstarted ones. When
        # the connection is made again, HELLO goes out at once, not at the next heartbeat.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        sock.connect(self.endpoint)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._read_loop(), name="worker-reader"),
                       asyncio.create_task(self._beat_loop(), name="worker-heartbeat"),
                       asyncio.create_task(self._watch_connection(monitor), name="worker-connection")]
        await self._send(Hello(PROTOCOL_VERSION, self.name))

    async def wait_ready(self, timeout: float | None = None) -> ModelCard:
        await asyncio.wait_for(self._ready.wait(), timeout)
        assert self.card is not None
        return self.card

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(WorkerUnavailableError("the gateway is shutting down"))
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def new_request_id(self) -> str:
        self._counter += 1
        return f"{self.name}-{self._counter}"

    async def generate(self, request: Generate | Embed) -> AsyncIterator[Accepted | Tokens | Finished | Embeddings]:
        """Send one request; raise BusyError / InvalidRequestError / WorkerUnavailableError
        instead of ACCEPTED, else yield ACCEPTED, the TOKENS messages and finally FINISHED (an
        EMBED: ACCEPTED, then EMBEDDINGS or FINISHED)."""
        if not self.ready:
            raise WorkerUnavailableError(self.version_error or "the worker is not ready (still loading, or unreachable)")
        rid = request.request_id
        queue: asyncio.Queue[Message | LmserveError] = asyncio.Queue()
        self._pending[rid] = queue
        self._since_beat += 1
        finished = False
        try:
            await self._send(request)
            first = await self._first_reply(queue)
            if isinstance(first, Rejected) and first.kind == HELLO_FIRST:
                # A new worker instance that has not heard our HELLO yet: greet it, then resend.
                self._ready.clear()
                await self._send(Hello(PROTOCOL_VERSION, self.name))
                try:
                    await asyncio.wait_for(self._ready.wait(), self.heartbeat_timeout)
                except TimeoutError:
                    finished = True
                    raise WorkerUnavailableError("the worker restarted and did not answer HELLO")
                while not queue.empty():
                    queue.get_nowait()
                await self._send(request)
                first = await self._first_reply(queue)
            if isinstance(first, LmserveError):
                finished = True
                raise first
            if isinstance(first, Busy):
                finished = True
                error = BusyError(first.message or "the worker is busy; retry shortly")
                error.retry_after = first.retry_after
                raise error
            if isinstance(first, Rejected):
                finished = True
                error = InvalidRequestError(first.message)
                error.status, error.kind = first.status, first.kind
                raise error
            if not isinstance(first, Accepted):
                finished = isinstance(first, Finished)
                raise WorkerUnavailableError(f"unexpected {type(first).__name__} before ACCEPTED")
            self._accepted.add(rid)
            yield first
            while True:
                item = await queue.get()
                if isinstance(item, LmserveError):
                    finished = True
                    raise item
                if isinstance(item, (Finished, Embeddings)):
                    finished = True
                    yield item
                    return
                if isinstance(item, Tokens):
                    yield item
        finally:
            # No await in here: this runs while the caller is being cancelled (client gone),
            # and the ABORT must still go out, so it goes out on a task of its own.
            self._pending.pop(rid, None)
            self._since_beat -= 1
            self._accepted.discard(rid)
            if rid in self._cut:
                self._cut.discard(rid)  # its ABORT went out when it was cut
            elif not finished and self._socket is not None:
                self._send_in_background(Abort(rid))

    async def _send_quietly(self, message: Message) -> None:
        try:
            await self._send(message)
        except Exception:  # the socket may be closing; the worker's heartbeat timeout covers it
            pass

    async def _send(self, message: Message) -> None:
        assert self._socket is not None, "start() the client first"
        await self._socket.send_multipart(message.frames())

    async def _read_loop(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:  # one bad message must not leave the gateway deaf to its worker
                self.receive(decode(frames))
            except ProtocolError as exc:
                self._malformed(frames, exc)
            except Exception:
                log.exception("taking in a message from the worker at %s failed", self.endpoint)

    def _malformed(self, frames: list[bytes], error: ProtocolError) -> None:
        """Drop a message that does not parse; the request it names, if one of ours, fails (and
        is aborted), rather than waiting for a reply that will not come."""
        log.warning("dropping a malformed message from the worker at %s: %s", self.endpoint, error)
        if frames and frames[0] == MsgType.MODEL_CARD.value and not self.ready:
            self.version_error = (f"the worker's model card does not parse ({error}); run the same lmserve "
                                  "release on gateway and worker")
        queue = self._pending.get(error.request_id or "")
        if queue is None or error.request_id in self._cut:
            return
        queue.put_nowait(WorkerUnavailableError(f"the worker sent a malformed reply: {error}"))
        self._send_in_background(Abort(error.request_id))

    def receive(self, message: Message) -> None:
        """Take in one message from the worker: a card, a heartbeat, or a reply to a request."""
        self._last_heard = time.monotonic()
        if isinstance(message, ModelCard):
            self._on_card(message)
        elif isinstance(message, Heartbeat):
            self.worker_load = (message.waiting, message.running)
            self.free_slots = message.free_slots
            self._since_beat = 0
            self.prefixes = frozenset(message.prefixes)
            if self.card is not None and message.instance and message.instance != self.card.instance:
                # A new worker: what the old one accepted is lost; requests it never
                # answered reached the new one, which asks for HELLO and gets them resent.
                self._ready.clear()
                self._fail_accepted("the worker restarted; requests in flight were lost")
        elif isinstance(message, Rejected) and message.kind == VERSION_MISMATCH:
            self.version_error = message.message
            log.error("%s", message.message)
        elif not isinstance(message, REPLIES):
            log.warning("ignoring a %s from the worker at %s", type(message).__name__, self.endpoint)
        else:
            rid = message.request_id
            queue = self._pending.get(rid)
            if queue is None or rid in self._cut:
                return
            if queue.qsize() >= self.max_buffered:
                self._cut_off(rid, queue)
                return
            queue.put_nowait(message)

    async def _first_reply(self, queue: asyncio.Queue) -> Message | LmserveError:
        """The worker answers every GENERATE at once (ACCEPTED, BUSY or REJECTED), or after its
        grammar compiled; silence this long means the request died with a worker."""
        try:
            return await asyncio.wait_for(queue.get(), FIRST_REPLY_TIMEOUT)
        except TimeoutError:
            return WorkerUnavailableError(f"the worker did not answer within {FIRST_REPLY_TIMEOUT:.0f} s")

    def _cut_off(self, rid: str, queue: asyncio.Queue) -> None:
        """Drop a request whose reader fell too far behind: free the worker, end the stream."""
        self._cut.add(rid)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(LmserveError(
            f"the client read the stream too slowly ({self.max_buffered} replies unread); it was cut off"))
        self._send_in_background(Abort(rid))

    def _send_in_background(self, message: Message) -> None:
        task = asyncio.get_running_loop().create_task(self._send_quietly(message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_card(self, card: ModelCard) -> None:
        if card.version != PROTOCOL_VERSION:
            self.version_error = version_mismatch_message(PROTOCOL_VERSION, card.version, "gateway")
            log.error("%s", self.version_error)
            return
        if self.card is not None and card.instance != self.card.instance:
            self._fail_accepted("the worker restarted; requests in flight were lost")
            self._forget_state()
        self.card = card
        self.version_error = None
        self._ready.set()

    def _forget_state(self) -> None:
        """What the last heartbeat said no longer holds: a new worker instance runs nothing and
        holds nothing until its own heartbeat says otherwise."""
        self.worker_load = (0, 0)
        self.free_slots = 0
        self.prefixes = frozenset()
        self._since_beat = 0

    def give_up(self, reason: str) -> None:
        """The worker is gone: fail its requests, forget what it said, say HELLO until one answers."""
        if self._ready.is_set():
            log.warning("%s", reason)
        self._forget_state()
        self._ready.clear()
        self._fail_all(WorkerUnavailableError(reason))

    def _fail_accepted(self, reason: str) -> None:
        for rid in list(self._accepted):
            queue = self._pending.get(rid)
            if queue is not None:
                queue.put_nowait(WorkerUnavailableError(reason))

    def _fail_all(self, error: LmserveError) -> None:
        for queue in self._pending.values():
            queue.put_nowait(error)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        dropped_handshakes = 0  # in a row: a worker holding another key, or one going down
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self.give_up(f"the connection to the worker at {self.endpoint} dropped")
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    dropped_handshakes = 0
                    if not self.ready:
                        await self._send(Hello(PROTOCOL_VERSION, self.name))
                elif event & HANDSHAKE_FAILED:
                    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        # a connection dropped in its handshake: libzmq tries again by itself,
                        # and only a drop that repeats says the keys do not fit
                        dropped_handshakes += 1
                        if dropped_handshakes < DROPPED_HANDSHAKES:
                            continue
                    refused = refused_handshake(event, self.endpoint, self.wire)
                    if refused != self.version_error:
                        log.error("%s", refused)
                    self.version_error = refused
                    if event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        await asyncio.sleep(REFUSED_RETRY)
                        self._reconnect()
        finally:
            if self._socket is not None:
                self._socket.disable_monitor()
            monitor.close(0)

    def _reconnect(self) -> None:
        assert self._socket is not None
        try:
            self._socket.disconnect(self.endpoint)
        except zmq.ZMQError:  # the refused connection is already gone
            pass
        self._socket.connect(self.endpoint)

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            silent_for = time.monotonic() - self._last_heard
            if self.ready and silent_for > self.heartbeat_timeout:
                self.give_up(f"the worker went silent ({silent_for:.1f} s without a heartbeat)")
            if self.ready:
                await self._send(Heartbeat(time.time()))
            else:
                await self._send(Hello(PROTOCOL_VERSION, self.name))
