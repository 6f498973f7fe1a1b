"""Several workers behind one gateway: which one a request goes to, and what happens when one fails.

A gateway holds one ``WorkerClient`` per worker it knows. Workers come from ``--worker``: a
comma-separated list of ZeroMQ endpoints, where a ``dns+tcp://NAME:PORT`` entry stands for every
address NAME resolves to, looked up again every few seconds (a Kubernetes headless Service, or a
compose service scaled with ``--scale worker=M``). Each worker's heartbeat tells its load
(waiting, running) and what its resident KV slots hold (``shared.prefix_digest``).

Routing (``--route prefix``, the default). Workers that would answer BUSY are skipped. Then:

- If some worker holds more of the prompt than the part every conversation shares (a system
  prompt and tool list, learnt from traffic: ``Conversations``), the conversation lives there.
  Each worker is given a cost in prompt tokens: what it would compute (the prompt less the
  prefix it holds) plus, when it has no free batch place, the wait for one, counted as the
  prompt tokens a worker computes meanwhile (``QueueCost``). The cheapest wins, so a
  conversation stays where its KV is warm unless waiting there costs more than recomputing.
- Otherwise (a new conversation, or one evicted everywhere) it goes to its home (the worker it
  last went to) if that can start it at once; else where it can start soonest, the least
  loaded, with the fewest conversations at home there; last, by the hash of its affinity key.

The access log names the choice:

- ``route=prefix``: a worker holding the conversation's own prefix won;
- ``route=hash``: no worker held it; it went back to its home, or (all else equal) to the
  worker its affinity key hashes to;
- ``route=load``: balance decided (a new conversation, or its warm worker was too busy for its
  prefix to pay).

``--route round-robin`` ignores all of that and takes turns (a baseline for ``bench.route``).

Failover. A worker that goes silent for the heartbeat timeout, or whose connection drops, leaves
the rotation at once and rejoins when it answers again. A request it had not started (no token
sent yet) is sent to the next-best worker, unseen by the client; a reply it was producing ends
with the dialect's error event. A worker that answers BUSY is skipped the same way; 429 comes
only when every worker is full.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gateway.flags import DEFAULT_QUEUE_TOKENS, MAX_BUFFERED, ROUTE_POLICIES
from gateway.neutral import NeutralRequest, Placement
from gateway.worker_client import WorkerClient
from shared.errors import BusyError, WorkerUnavailableError
from shared.prefix_digest import ROUTE_BLOCK, held_prefix, prefix_digests
from shared.protocol import (
    DEFAULT_ENDPOINT,
    Accepted,
    Embed,
    Embeddings,
    Finished,
    FinishReason,
    Generate,
    ModelCard,
    Tokens,
)
from shared.wire_security import ClientKeys

log = logging.getLogger("lmserve.gateway")

DNS_SCHEME = "dns+tcp://"
RESOLVE_INTERVAL = 5.0  # seconds between lookups of a dns+tcp:// name


def parse_endpoints(spec: str) -> list[str]:
    """``--worker``'s value: endpoints separated by commas."""
    endpoints = [part.strip() for part in spec.split(",") if part.strip()]
    return endpoints or [DEFAULT_ENDPOINT]


def resolve(spec: str) -> list[str]:
    """The tcp:// endpoints a dns+tcp://NAME:PORT entry stands for now (empty if NAME does not resolve)."""
    host, _, port = spec[len(DNS_SCHEME):].rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return []
    addresses = sorted({info[4][0] for info in infos})
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addresses]


def affinity_key(request: NeutralRequest, prompt: list[int]) -> str | None:
    """What keeps a conversation's turns on one worker: the client's session id when it sends
    one (Claude Code's session header, OpenAI's ``prompt_cache_key``); else the conversation's
    opening (the messages through the first user message), which every later turn repeats;
    for a bare text prompt, its first block of tokens. None when there is nothing to go by."""
    if request.cache_hint:
        return "session:" + request.cache_hint
    if request.messages:
        opening = []
        for message in request.messages:
            opening.append(json.dumps(message, sort_keys=True, default=str))
            if message.get("role") == "user":
                break
        return hashlib.blake2b("\n".join(opening).encode(), digest_size=16).hexdigest()
    digests = prefix_digests(prompt)
    return digests[0].hex() if digests else None


def _rendezvous(key: str, endpoint: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{endpoint}".encode(), digest_size=8).digest()


class Conversations:
    """What a gateway learns from the conversations it routes (bounded, least recently seen
    forgotten first):

    - which leading prompt blocks more than one conversation has sent (a system prompt and tool
      list every conversation starts with): holding those says nothing about where a
      conversation lives, and routing on them alone would pile every conversation onto the
      first worker that computed them;
    - each conversation's home, the worker it last went to, and how many conversations each
      worker is home to, to spread new ones.
    """

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> its one conversation, None: shared
        self._homes: OrderedDict[str, str] = OrderedDict()  # affinity key -> worker endpoint
        self._homed: dict[str, int] = {}  # worker endpoint -> conversations at home there

    def shared_prefix(self, digests: list[bytes], affinity: str | None) -> int:
        """Note a prompt's blocks under its conversation; the leading tokens of it that other
        conversations have sent too."""
        if affinity is None:
            return 0
        shared, leading = 0, True
        for digest in digests:
            owner = self._blocks.get(digest, affinity)
            owner = owner if owner == affinity else None
            self._blocks[digest] = owner
            self._blocks.move_to_end(digest)
            leading = leading and owner is None
            shared += ROUTE_BLOCK if leading else 0
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return shared

    def home(self, affinity: str | None) -> str | None:
        return self._homes.get(affinity) if affinity is not None else None

    def homed(self, endpoint: str) -> int:
        return self._homed.get(endpoint, 0)

    def settle(self, affinity: str | None, endpoint: str) -> None:
        if affinity is None:
            return
        previous = self._homes.pop(affinity, None)
        if previous is not None:
            self._homed[previous] -= 1
        self._homes[affinity] = endpoint
        self._homed[endpoint] = self._homed.get(endpoint, 0) + 1
        while len(self._homes) > self.capacity // 16:
            _, gone = self._homes.popitem(last=False)
            self._homed[gone] -= 1


class QueueCost:
    """What waiting for a batch place costs, in the prompt tokens a worker computes meanwhile:
    its prefill rate times how long a request holds a batch place, both measured by this
    gateway on its requests that started at once (moving averages), unless ``--route-queue-tokens``
    fixes the figure. Before anything is measured, ``DEFAULT_QUEUE_TOKENS``."""

    WEIGHT = 0.3  # of a new sample in the moving averages

    def __init__(self, fixed: int = 0):
        self.fixed = fixed
        self.rate: float | None = None  # prompt tokens computed per second
        self.hold: float | None = None  # seconds from sending a request to its end

    def observe(self, computed: int, first_token_after: float | None, ended_after: float) -> None:
        if first_token_after is not None and first_token_after > 0 and computed >= ROUTE_BLOCK:
            self.rate = self._average(self.rate, computed / first_token_after)
        self.hold = self._average(self.hold, ended_after)

    def _average(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.WEIGHT) * old + self.WEIGHT * sample

    @property
    def tokens(self) -> float:
        if self.fixed:
            return float(self.fixed)
        if self.rate is None or self.hold is None:
            return float(DEFAULT_QUEUE_TOKENS)
        return self.rate * self.hold


class WorkerPool:
    def __init__(self, spec: str, heartbeat_interval: float, heartbeat_timeout: float, *,
                 max_buffered: int = MAX_BUFFERED, policy: str = "prefix", queue_tokens: int = 0,
                 wire: ClientKeys | None = None):
        if policy not in ROUTE_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(ROUTE_POLICIES)})")
        self.specs = parse_endpoints(spec)
        self.policy = policy
        self.queue_cost = QueueCost(queue_tokens)
        self.conversations = Conversations()
        self._client_args = (heartbeat_interval, heartbeat_timeout)
        self._max_buffered = max_buffered
        self._wire = wire
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.clients: dict[str, WorkerClient] = {}  # endpoint -> client, in the order they were found
        self.retired: list[WorkerClient] = []  # gone from DNS, closed once their requests end
        self._card: ModelCard | None = None  # the model this pool serves: the first worker's
        self._mismatched: set[str] = set()  # instances of workers serving another model, logged once
        self._counter = 0
        self._turn = itertools.count()
        self._resolver: asyncio.Task | None = None
        self._resolved: dict[str, list[str]] = {}  # each dns+tcp:// entry's last answer

    # --- membership -------------------------------------------------------------------------------

    async def start(self) -> None:
        for spec in self.specs:
            if not spec.startswith(DNS_SCHEME):
                await self._add(spec)
        if any(spec.startswith(DNS_SCHEME) for spec in self.specs):
            await self.refresh()
            self._resolver = asyncio.create_task(self._resolve_loop(), name="worker-resolver")

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
            try:
                await self._resolver
            except (asyncio.CancelledError, Exception):
                pass
        for client in [*self.clients.values(), *self.retired]:
            await client.close()
        self.clients.clear()
        self.retired.clear()

    async def _add(self, endpoint: str) -> None:
        client = WorkerClient(endpoint, *self._client_args, name=self.name, max_buffered=self._max_buffered,
                              wire=self._wire)
        self.clients[endpoint] = client
        await client.start()

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(RESOLVE_INTERVAL)
            try:
                await self.refresh()
            except Exception:  # a lookup must never end the loop
                log.exception("looking up the workers failed")

    async def refresh(self) -> None:
        """Follow the dns+tcp:// names: connect to new addresses, retire vanished ones."""
        wanted = [spec for spec in self.specs if not spec.startswith(DNS_SCHEME)]
        for spec in self.specs:
            if spec.startswith(DNS_SCHEME):
                found = await asyncio.to_thread(resolve, spec)
                if not found and self._resolved.get(spec):
                    # a failed lookup is not a fleet gone: keep the last answer until the next one
                    log.warning("%s resolves to nothing now; keeping its last %d worker(s)",
                                spec, len(self._resolved[spec]))
                    found = self._resolved[spec]
                self._resolved[spec] = found
                wanted += found
        for endpoint in wanted:
            if endpoint not in self.clients:
                log.info("worker %s found", endpoint)
                await self._add(endpoint)
        for endpoint in [e for e in self.clients if e not in wanted]:
            log.info("worker %s no longer resolves; it takes no new requests", endpoint)
            self.retired.append(self.clients.pop(endpoint))
        for client in [c for c in self.retired if c.in_flight == 0]:
            self.retired.remove(client)
            await client.close()

    # --- what the gateway reads -------------------------------------------------------------------

    def serving(self) -> list[WorkerClient]:
        """The workers ready to take requests for this pool's model."""
        ready = [c for c in self.clients.values() if c.ready and c.card is not None]
        if self._card is None or not any(c.card.fingerprint == self._card.fingerprint for c in ready):
            self._card = ready[0].card if ready else self._card
        if self._card is None:
            return []
        serving, instances = [], set()
        for client in ready:
            if client.card.instance in instances:
                continue  # one worker reached at two addresses (a name with A and AAAA records)
            instances.add(client.card.instance)
            if client.card.fingerprint == self._card.fingerprint:
                serving.append(client)
                self._mismatched.discard(client.card.instance)
            elif client.card.instance not in self._mismatched:
                self._mismatched.add(client.card.instance)
                log.error("worker %s serves another model (%s, not %s); it gets no requests",
                          client.endpoint, client.card.model_id, self._card.model_id)
        return serving

    @property
    def ready(self) -> bool:
        return bool(self.serving())

    @property
    def card(self) -> ModelCard | None:
        """The model card of a serving worker; the same object while that worker serves."""
        serving = self.serving()
        if not serving:
            return None
        for client in serving:
            if client.card is self._card:
                return self._card
        self._card = serving[0].card
        return self._card

    @property
    def version_error(self) -> str | None:
        return next((c.version_error for c in self.clients.values() if c.version_error), None)

    @property
    def worker_load(self) -> tuple[int, int]:
        """Waiting and running over the serving workers."""
        loads = [c.worker_load for c in self.serving()]
        return sum(w for w, _ in loads), sum(r for _, r in loads)

    def describe(self) -> list[dict[str, Any]]:
        """Every worker this gateway knows, for /health."""
        serving = set(map(id, self.serving()))
        now = time.monotonic()
        return [{"endpoint": c.endpoint, "worker": c.card.capabilities.worker if c.card else None,
                 "ready": id(c) in serving, "waiting": c.worker_load[0], "running": c.worker_load[1],
                 "free_slots": c.free_slots, "held_blocks": len(c.prefixes),
                 "in_flight": c.in_flight,
                 "last_heard_s": round(now - c.last_heard, 1) if c.last_heard else None}
                for c in self.clients.values()]

    def new_request_id(self) -> str:
        self._counter += 1
        return f"{self.name}-{self._counter}"

    # --- routing ----------------------------------------------------------------------------------

    @staticmethod
    def _full(client: WorkerClient) -> bool:
        """Whether the worker would answer BUSY, by its last heartbeat (the same rule as its queue)."""
        caps = client.card.capabilities
        waiting, running = client.worker_load
        return waiting + 1 - max(0, caps.batch - running) > caps.queue

    def choose(self, prompt: list[int], affinity: str | None,
               skip: set[WorkerClient] = frozenset()) -> tuple[WorkerClient, str] | None:
        """The worker for a prompt and the rule that picked it, or None when none can take it."""
        candidates = [c for c in self.serving() if c not in skip and not self._full(c)]
        if not candidates:
            return None
        if self.policy == "round-robin":
            return candidates[next(self._turn) % len(candidates)], "round-robin"
        digests = prefix_digests(prompt)
        held = {c: held_prefix(digests, c.prefixes) for c in candidates}
        shared = self.conversations.shared_prefix(digests, affinity)
        load = {c: c.load for c in candidates}
        # batch places that must free up before the request starts there
        waits = {c: max(0, load[c] + 1 - c.card.capabilities.batch) / c.card.capabilities.batch
                 for c in candidates}
        turn = next(self._turn)

        def tie(client: WorkerClient) -> tuple:
            """Last resorts: the conversation's hash, else a rotation."""
            mark = _rendezvous(affinity, client.endpoint) if affinity is not None else b""
            return [-byte for byte in mark], (candidates.index(client) - turn) % len(candidates)

        if any(h > shared for h in held.values()):
            # The conversation lives on some worker: the cheapest, counting what it would compute
            # and the wait for a batch place.
            queue_tokens = self.queue_cost.tokens
            best = min(candidates, key=lambda c: (len(prompt) - held[c] + queue_tokens * waits[c], load[c], tie(c)))
            route = "prefix" if held[best] > shared else "load"
        else:
            # No worker holds more of it than every conversation shares (a new conversation, or
            # one evicted everywhere): its home if that can start it at once, else where it can
            # start soonest, among those the least loaded and with the fewest conversations.
            home = self.conversations.home(affinity)
            keys = {c: (waits[c] > 0, c.endpoint != home, load[c], self.conversations.homed(c.endpoint), tie(c))
                    for c in candidates}
            best, *others = sorted(candidates, key=keys.get)
            # named by what told the best from the runner-up: its home or its hash, else balance
            decided = next((i for i, (a, b) in enumerate(zip(keys[best], keys[others[0]])) if a != b), 0) \
                if others else 0
            route = "hash" if affinity is not None and decided in (1, 4) else "load"
        self.conversations.settle(affinity, best.endpoint)
        return best, route

    async def generate(self, request: Generate | Embed, affinity: str | None = None, placement: Placement | None = None
                       ) -> AsyncIterator[Accepted | Tokens | Finished | Embeddings]:
        """``WorkerClient.generate`` over the pool: the chosen worker's ACCEPTED, TOKENS and
        FINISHED (an EMBED's EMBEDDINGS), moving on to another worker while none of the reply has
        been sent. An EMBED holds no prompt any worker has cached: it goes where the load is least."""
        placement = placement if placement is not None else Placement()
        tried: set[WorkerClient] = set()
        busy: BusyError | None = None
        lost: WorkerUnavailableError | None = None
        accepted = False
        while True:
            choice = self.choose(request.prompt if isinstance(request, Generate) else [], affinity, tried)
            if choice is None:
                if busy is not None:
                    raise busy
                if lost is not None:
                    raise lost
                if self.serving():
                    raise BusyError("every worker's queue is full; retry shortly")
                raise WorkerUnavailableError(
                    self.version_error or "no worker is ready (still loading, or unreachable)")
            client, route = choice
            tried.add(client)
            placement.worker = client.card.capabilities.worker or client.endpoint
            placement.route = route
            started = False
            # a request that starts at once measures what waiting costs (QueueCost)
            at_once = client.load < client.card.capabilities.batch
            sent, first_token_after = time.monotonic(), None
            try:
                async with aclosing(client.generate(request)) as stream:
                    async for message in stream:
                        if isinstance(message, Accepted):
                            if accepted:  # the client saw one from the worker that failed
                                continue
                            accepted = True
                        else:
                            started = True
                            if first_token_after is None and isinstance(message, Tokens):
                                first_token_after = time.monotonic() - sent
                            if isinstance(message, Finished) and at_once and message.reason != FinishReason.ABORT:
                                self.queue_cost.observe(message.prompt_tokens - message.cached_tokens,
                                                        first_token_after, time.monotonic() - sent)
                        yield message
                return
            except BusyError as exc:
                busy = exc
            except WorkerUnavailableError as exc:
                if started:
                    raise
                lost = exc
                log.warning("worker %s failed before starting %s (%s); trying another",
                            placement.worker, request.request_id, exc)
            placement.resent += 1
