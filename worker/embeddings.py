"""Embeddings (EMBED): for each input, the mean of the model's final normed hidden states (the
output norm's rows, what the logits are read from) over all of its positions.

Mean pooling, because the model is a causal LM and not trained to embed: no one position stands
for the input (the last has read all of it, but is shaped to predict the token after it), and
the mean over every position is the usual choice for such a model (llama-server's
``--pooling mean``). The gateway scales each mean to unit length.

Requests arrive on the IO thread: ``submit`` checks what only this worker knows (its vocabulary,
its context) and answers ACCEPTED, BUSY or REJECTED at once. The passes run on the engine thread,
which the scheduler's loop lends between its steps (``run_pending``), one pass of at most
``chunk`` tokens at a time: an embedding never races a generation for the engine, nor holds it
for longer than a prompt chunk would. Inputs go into one pass together while they fit in a
chunk; a longer one is read alone, a chunk at a time, through a cache of its own. An input's
rows do not depend on what shared its pass (the kernels are batch-invariant) and its chunks
only on its own length, so a batch embeds each input exactly as it would be embedded alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shared.errors import InvalidRequestError
from shared.protocol import Accepted, Busy, Embed, Embeddings, Finished, FinishReason, Rejected
from worker.engine import Engine
from worker.engine.kv_cache import KVCache
from worker.stream import Send

log = logging.getLogger("lmserve.worker")


@dataclass
class LongInput:
    """An input longer than a chunk, part read: its cache, the sum of its rows so far, how many
    of its tokens are read."""
    cache: KVCache
    total: np.ndarray
    read: int = 0


@dataclass
class EmbeddingJob:
    gateway: bytes
    request: Embed
    sums: list[np.ndarray] = field(default_factory=list)  # per input read so far: its rows summed
    reading: LongInput | None = None
    aborted: str | None = None  # why, once its gateway asked or went silent

    @property
    def key(self) -> tuple[bytes, str]:
        return self.gateway, self.request.request_id


class Embedder:
    """The EMBED requests a worker has accepted, and the passes that answer them."""

    def __init__(self, engine: Engine, ctx: int, queue: int, chunk: int, send: Send, wake: Callable[[], None]):
        self.engine = engine
        self.ctx = ctx  # the longest input, in tokens (--ctx)
        self.queue = queue  # requests held beyond which the next is answered BUSY (--queue)
        self.chunk = chunk  # tokens per pass (--prefill-chunk)
        self.send = send
        self.wake = wake  # the engine thread's loop: do not sleep, there is work
        self.lock = threading.Lock()  # guards jobs
        self.jobs: deque[EmbeddingJob] = deque()

    # --- called from the IO thread --------------------------------------------------------------

    def submit(self, gateway: bytes, request: Embed) -> None:
        rid = request.request_id
        try:
            self.check(request)
        except InvalidRequestError as exc:
            self.send(gateway, Rejected(rid, exc.status, exc.kind, exc.message))
            return
        with self.lock:
            if any(job.key == (gateway, rid) for job in self.jobs):
                self.send(gateway, Rejected(rid, 400, InvalidRequestError.kind, f"request id {rid!r} is already in flight"))
                return
            if len(self.jobs) >= self.queue:
                self.send(gateway, Busy(rid, 1.0, f"the worker's embedding queue is full ({len(self.jobs)} waiting, "
                                                  f"--queue {self.queue})"))
                return
            self.send(gateway, Accepted(rid, len(self.jobs)))
            self.jobs.append(EmbeddingJob(gateway, request))
        self.wake()

    def check(self, request: Embed) -> None:
        """What the wire's types cannot say: inputs there are, each within the vocabulary and the context."""
        if not request.inputs:
            raise InvalidRequestError("an EMBED needs at least one input")
        n_vocab = self.engine.model.hp.n_vocab
        for i, ids in enumerate(request.inputs):
            if len(ids) > self.ctx:
                raise InvalidRequestError(f"input {i} is {len(ids)} tokens, more than this worker's context of "
                                          f"{self.ctx} (--ctx)", code="context_length_exceeded")
            bad = next((t for t in ids if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"input {i} holds {bad}, which is not a token id of this model "
                                          f"(0 to {n_vocab - 1})")

    def abort(self, gateway: bytes, request_id: str, why: str = "its gateway asked") -> None:
        with self.lock:
            for job in self.jobs:
                if job.key == (gateway, request_id):
                    job.aborted = why
                    self.wake()

    def abort_gateway(self, gateway: bytes, why: str) -> int:
        """A gateway went silent: drop what it asked for. Returns how many requests."""
        with self.lock:
            mine = [job for job in self.jobs if job.gateway == gateway]
            for job in mine:
                job.aborted = why
        if mine:
            self.wake()
        return len(mine)

    # --- the engine thread ------------------------------------------------------------------------

    def run_pending(self) -> None:
        """One pass for the first request waiting, and its answer once its inputs are all read."""
        with self.lock:
            job = self.jobs[0] if self.jobs else None
        if job is None:
            return
        rid = job.request.request_id
        if job.aborted is not None:
            self._end(job, Finished(rid, FinishReason.ABORT, error=job.aborted))
            return
        try:
            self._read_next(job)
        except Exception:
            log.exception("embedding %s failed", rid)
            self._end(job, Finished(rid, FinishReason.ERROR, error="the engine failed on this embedding request"))
            return
        inputs = job.request.inputs
        if len(job.sums) == len(inputs):
            means = [(total / len(ids)).tolist() for total, ids in zip(job.sums, inputs)]
            self._end(job, Embeddings(rid, means, sum(map(len, inputs))))
        else:
            self.wake()  # more of it to read: the loop goes on at once

    def _read_next(self, job: EmbeddingJob) -> None:
        """Read the inputs that fit in one pass together, or the next chunk of a long one."""
        inputs, model = job.request.inputs, self.engine.model
        first = len(job.sums)
        if job.reading is None and len(inputs[first]) > self.chunk:
            job.reading = LongInput(self.engine.new_cache(len(inputs[first])), np.zeros(model.hp.n_embd))
        if job.reading is not None:
            long, ids = job.reading, inputs[first]
            piece = ids[long.read:long.read + self.chunk]
            rows = model.forward([(long.cache, piece)], all_logits=True, hidden=True)[0]
            long.total += rows.sum(axis=0, dtype=np.float64)
            long.read += len(piece)
            if long.read == len(ids):
                job.sums.append(long.total)
                job.reading = None
            return
        end, tokens = first, 0
        while end < len(inputs) and tokens + len(inputs[end]) <= self.chunk:
            tokens += len(inputs[end])
            end += 1
        group = inputs[first:end]
        rows = model.forward([(self.engine.new_cache(len(ids)), ids) for ids in group], all_logits=True, hidden=True)
        job.sums.extend(each.sum(axis=0, dtype=np.float64) for each in rows)

    def _end(self, job: EmbeddingJob, answer: Embeddings | Finished) -> None:
        with self.lock:
            self.jobs.remove(job)
        self.send(job.gateway, answer)
        if self.jobs:
            self.wake()
