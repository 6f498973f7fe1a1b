"""Spill resident KV to the kvstore and restore it: the worker's half of KV reuse beyond RAM.

As a prompt is read, and again when its request finishes, the full chunks of its slot that the
store lacks are copied out (on the engine thread: a memcpy, into the buffer of a chunk written
already where there is one) and written by a background thread that runs only on a core the
kernels leave idle (off the decode path, and out of the prefill's way). Spilling chunk by chunk as they fill keeps the copies waiting for the
writer to a few chunks, where spilling a long prompt at its end held all of it twice. When a
request arrives, the longest run of consecutive chunks the store holds beyond what its slot
already has is read back into the slot, and only the rest of the prompt is computed. Any worker
of the same model (same fingerprint) can restore what another spilled.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass

import msgpack
import numpy as np

from kvstore.chunks import chunk_keys
from kvstore.store import KVChunk, KVStore, StateRecord
from worker import metrics
from worker.engine.kv_cache import KVCache

log = logging.getLogger("lmserve.kvstore")


@dataclass
class SpillStats:
    chunks_written: int = 0
    chunks_restored: int = 0
    chunks_dropped: int = 0  # the write queue was full


def _yield_to_compute() -> None:
    """Run this thread only on a core nothing else wants (Linux's SCHED_IDLE; elsewhere nothing
    changes). A chunk's tag and write take some 60 ms of a core; at normal priority they took a
    core from the kernels' threads mid-step, and every parallel loop waited for the thread
    that lost it. Here the writer fills the gaps between and around the steps instead."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: the calling thread
    except OSError:
        pass


class KVSpiller:
    def __init__(self, store: KVStore, fingerprint: str, chunk_tokens: int, max_pending_bytes: int = 256 << 20):
        self.store = store
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self.max_pending_bytes = max_pending_bytes
        self.stats = SpillStats()
        self._pending_bytes = 0
        self._spare: list[np.ndarray] = []  # written chunks' buffers, for the next copies
        self._in_flight: set[str] = set()  # queued, not yet written: not queued again
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, KVChunk | StateRecord] | None] = queue.Queue()
        self.writer = threading.Thread(target=self._writer, name="kv-spill", daemon=True)
        self.writer.start()

    def keys_for(self, tokens: list[int], namespace: str = "") -> list[str]:
        # a cartridge's pseudo-ids lead the tokens of a cache behind it, so they key its chunks apart;
        # a tenant's namespace keys its own chunks apart from every other tenant's
        return chunk_keys(self.fingerprint, tokens, self.chunk_tokens, prefix_ids=(namespace,) if namespace else ())

    # --- restore (engine thread) -----------------------------------------------------------

    def restore(self, cache: KVCache, prompt: list[int], resident: int, namespace: str = "") -> int:
        """Extend the cache's valid prefix of ``prompt`` from the store; returns its new length.

        At least one prompt token is always left to compute (its logits start the reply). A
        cache with recurrent state is restored only into an empty one, and only as far as a
        chunk whose states the store holds too.
        """
        usable = self.keys_for(prompt[:len(prompt) - 1], namespace)
        first = resident // self.chunk_tokens  # the chunk holding the first position to fill
        if len(usable) <= first:
            return resident
        available = self.store.present(usable)
        states = None
        if not cache.rewindable:
            if resident:
                return resident  # the slot's state is the one to continue
            available, states = self._last_state(usable[:available])
        length = resident
        k_shape, v_shape = cache.chunk_shapes(self.chunk_tokens)
        for index in range(first, available):
            record = self.store.get(usable[index])
            if record is None:
                break
            try:
                chunk = KVChunk.decode(*record, k_shape, v_shape, cache.dtype.name)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                self.store.rejections.report(usable[index], str(exc))
                self.store.delete(usable[index])
                break
            start = index * self.chunk_tokens
            if cache.spilled is not None:  # in the store, where it came from: sliding layers may let go of it
                cache.spilled = max(cache.spilled, start + self.chunk_tokens)
            cache.restore(start, chunk.keys, chunk.values, prompt[start:start + self.chunk_tokens])
            length = start + self.chunk_tokens
            self.stats.chunks_restored += 1
            metrics.KV_CHUNKS.labels("restored").inc()
            metrics.KV_BYTES.labels("restored").inc(chunk.keys.nbytes + chunk.values.nbytes)
        if states is not None:
            if length != available * self.chunk_tokens:  # a chunk went missing on the way
                cache.truncate(0)
                return 0
            cache.recurrent = states.states
        # asked for and not restored: absent from the store, or unusable
        metrics.KV_CHUNKS.labels("missed").inc(len(usable) - max(first, length // self.chunk_tokens))
        return length

    @staticmethod
    def state_key(chunk_key: str) -> str:
        """Where the recurrent states at the end of a chunk are kept."""
        return chunk_key + "-state"

    def _last_state(self, present: list[str]) -> tuple[int, StateRecord | None]:
        """The most of these consecutive chunks whose end's states the store holds, and those."""
        for count in range(len(present), 0, -1):
            record = self.store.get(self.state_key(present[count - 1]))
            if record is None:
                continue
            try:
                return count, StateRecord.decode(*record)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                self.store.rejections.report(self.state_key(present[count - 1]), str(exc))
                self.store.delete(self.state_key(present[count - 1]))
        return 0, None

    # --- spill (engine thread copies, writer thread stores) ----------------------------------

    def spill(self, cache: KVCache, namespace: str = "") -> int:
        """Queue the cache's full chunks the store lacks; returns how many were queued."""
        tokens = list(cache.tokens[:cache.length])
        keys = self.keys_for(tokens, namespace)
        have = self.store.present(keys)
        queued = 0
        # chunks whose sliding layers were given back cannot be exported (the store lost them)
        first = max(have, -(-cache.released // self.chunk_tokens))
        spilled = len(keys)
        for index in range(first, len(keys)):
            # a recurrent cache's states at the chunk's end go first: restoring looks for them
            end = (index + 1) * self.chunk_tokens
            if end in cache.snapshots:
                self._queue_record(self.state_key(keys[index]), StateRecord(cache.snapshots.pop(end)))
            size = self.chunk_tokens * cache.bytes_per_token
            with self._lock:
                if keys[index] in self._in_flight:
                    continue
                if self._pending_bytes + size > self.max_pending_bytes:
                    self.stats.chunks_dropped += len(keys) - index
                    metrics.KV_CHUNKS.labels("dropped").inc(len(keys) - index)
                    spilled = index
                    break
                self._pending_bytes += size
                self._in_flight.add(keys[index])
            buffer = self._buffer(cache.export_bytes(self.chunk_tokens))
            k, v = cache.export(index * self.chunk_tokens, self.chunk_tokens, into=buffer)
            self._queue.put((keys[index], KVChunk(k, v, buffer)))
            queued += 1
        for end in [at for at in cache.snapshots if at <= have * self.chunk_tokens]:
            del cache.snapshots[end]  # their chunks were in the store already
        if cache.spilled is not None:
            cache.spilled = max(cache.spilled, spilled * self.chunk_tokens)
        return queued

    def spill_logged(self, cache: KVCache, namespace: str, whose: str) -> None:
        """``spill``, a failure logged rather than raised: a reply never fails for the store."""
        try:
            self.spill(cache, namespace)
        except Exception:
            log.exception("spilling KV of %s failed", whose)

    def spill_filled(self, cache: KVCache, namespace: str, added: int, whose: str) -> None:
        """After a prompt step read ``added`` tokens: spill the chunks it filled (the rest goes
        when the request ends)."""
        if cache.length // self.chunk_tokens > (cache.length - added) // self.chunk_tokens:
            self.spill_logged(cache, namespace, whose)

    def spill_idle(self, slots) -> None:
        """On shutdown: keep what every idle slot holds, so a restarted worker can restore it."""
        for slot in slots:
            if not slot.busy and slot.cache.length:
                self.spill(slot.cache, slot.namespace)
        self.close()

    SPARE_BUFFERS = 1  # a chunk is written well before the prompt's next one is copied

    def _buffer(self, size: int) -> np.ndarray:
        """A buffer of ``size`` bytes for a chunk's copy: a written chunk's, or a new one."""
        with self._lock:
            while self._spare:
                buffer = self._spare.pop()
                if buffer.nbytes == size:
                    return buffer
        return np.empty(size, dtype=np.uint8)

    def _queue_record(self, key: str, record: StateRecord) -> None:
        """Queue a small record for the writer (not counted against the pending budget)."""
        with self._lock:
            if key in self._in_flight:
                return
            self._in_flight.add(key)
        self._queue.put((key, record))

    def _writer(self) -> None:
        _yield_to_compute()
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, chunk = item
            size = chunk.keys.nbytes + chunk.values.nbytes if isinstance(chunk, KVChunk) else 0
            try:
                self.store.put(key, *chunk.encode())
                if size:
                    self.stats.chunks_written += 1
                    metrics.KV_CHUNKS.labels("written").inc()
                    metrics.KV_BYTES.labels("spilled").inc(size)
            finally:
                with self._lock:
                    self._pending_bytes -= size
                    self._in_flight.discard(key)
                    if isinstance(chunk, KVChunk) and chunk.buffer is not None and len(self._spare) < self.SPARE_BUFFERS:
                        self._spare.append(chunk.buffer)
                self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued chunk is written (shutdown, tests)."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()
        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self.writer.join(5)
