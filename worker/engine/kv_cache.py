"""Per-sequence KV cache: keys and values of every layer for the tokens seen so far.

Storage grows in whole blocks as a sequence gets longer, so a short chat does not pay for a
full context, and ``truncate`` keeps a shared prefix for reuse by the next request. The keys
of all layers are one anonymous memory mapping, and so are the values: a cache that goes is
returned to the system at once (no holes left in the heap), and a cache that grows lets go of
each old layer's pages as soon as that layer is copied, so growing holds the old block and one
layer of the new, not both blocks. Keys and values are held as IEEE halves (``f16``, the
default: half the memory, spilled chunks included) or as float32 (``f32``); either way
attention computes in float32. Keys lie in runs of RUN positions, each run dim by dim
(``key_runs``): the compiled attention loads a vector of keys at once, with no turning of rows
into columns; ``key_rows`` and ``put_key_rows`` read and write them as rows [K, n, d], which is
also how ``export`` hands them to the kvstore.

Layers that attend over a sliding window never read a key again once it is a window (and a key
block) behind the last position: as a sequence grows, the pages of those positions are given
back (``released``), so a long conversation holds its sliding layers' window (and its last
reply, see ``resumable_at``), not its length.
The cache can then continue only from prefixes whose windows it still holds: a shorter one is
started afresh (``truncate``), and those positions are never exported (a kvstore spills them
before they go: ``spilled``).
"""

from __future__ import annotations

import mmap

import numpy as np

from worker.engine import kernels
from worker.engine.kernels import attention
from worker.engine.kernels.attention import KEYS_WHOLE, RUN

GROWTH_BLOCK = 256  # tokens added per growth step
# a decode step's attention reads whole key blocks of 64 from the one holding a window's first
# key; a prompt's tile path reads blocks of 128, which may reach into positions given back: those
# read as zeros, and it weighs them 0 as it does every key outside a row's window
READ_MARGIN = 64
RELEASE_STEP = 256  # positions of sliding layers given back at once
KV_TYPES = {"f16": np.float16, "f32": np.float32}


class KVCache:
    """keys[l]: [K, runs, d, RUN] (``key_runs``), values[l]: [K, capacity, d] of ``dtype``; the
    first ``length`` positions are valid.

    Every layer has the same K, d and dv unless ``layers`` gives each its own (K, d, dv), as in
    families that mix sliding-window layers with global ones of another shape. Layers of one
    shape are views of one [L, K, capacity, d] block of keys and one of values."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, max_tokens: int,
                 value_dim: int | None = None, kv_type: str = "f16",
                 layers: list[tuple[int, int, int]] | None = None, windows: list[int] | None = None):
        # the compiled attention over a cache is a parallel kernel: numba's pool must be running
        # before one loaded from the disk cache is called (numba issue 8578)
        kernels.start_threads()
        self.kv_type = kv_type
        self.dtype = np.dtype(KV_TYPES[kv_type])
        self.n_layer = n_layer
        self.n_kv_head = n_kv_head
        self.head_dim = head_dim
        self.value_dim = value_dim or head_dim
        self.geometry = [tuple(g) for g in layers] if layers else [(n_kv_head, head_dim, self.value_dim)] * n_layer
        if len(self.geometry) != n_layer:
            raise ValueError(f"{len(self.geometry)} layer shapes given for {n_layer} layers")
        self.uniform = len(set(self.geometry)) == 1
        # layers of one shape share a block: shape -> the layers in it, in order
        self._groups: dict[tuple[int, int, int], list[int]] = {}
        for layer, shape in enumerate(self.geometry):
            self._groups.setdefault(shape, []).append(layer)
        # each layer's sliding window (0: it reads the whole context)
        self.windows = list(windows) if windows else [0] * n_layer
        if len(self.windows) != n_layer:
            raise ValueError(f"{len(self.windows)} windows given for {n_layer} layers")
        self.reach = max(self.windows) + READ_MARGIN if any(self.windows) else 0
        self.released = 0  # sliding layers hold no position below this (their pages given back)
        # the sliding layers keep the window before this position (0: none): where the prompt of
        # the request being served ends, less its last token, so that the conversation's next
        # request, which repeats that prompt and goes on, continues here however the reply is
        # rendered back to it (and so does the same prompt sent again)
        self.resumable_at = 0
        # positions below this are a prompt's, fed by prefill: attention takes their rows through
        # the tile unit where there is one, in bfloat16 (``attention._attend_task_tiles``); a
        # decode step's, a verified draft's and the rest through the float32 vector loops. Each
        # way gives a row the same bits in any chunk or batch, so a prompt read again (the same
        # request, or its last token recomputed) reads as before
        self.prompt_end = 0
        # positions below this are in the kvstore (or on their way): only those may be released;
        # None: no kvstore, nothing to wait for
        self.spilled: int | None = None
        self.max_tokens = max_tokens
        self.length = 0
        self.tokens: list[int] = []  # the token ids whose keys/values are held
        # Recurrent layers' states (linear attention), by layer, after the tokens held; a cache
        # that has them is not rewindable: it holds its whole length or nothing.
        self.recurrent: dict[int, list[np.ndarray]] = {}
        # With recurrent state: copies of it at every multiple of ``snapshot_every`` positions
        # reached (0: none taken), kept until the kvstore has them beside their chunk's KV.
        self.snapshot_every = 0
        self.snapshots: dict[int, dict[int, list[np.ndarray]]] = {}
        self.rewindable = True
        self.capacity = 0
        self.written = 0  # positions written since the storage was made: what its pages hold
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self._blocks: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}  # shape -> keys, values

    def _grow(self, needed: int) -> None:
        if needed > self.max_tokens:
            raise ValueError(f"KV cache holds at most {self.max_tokens} tokens, {needed} needed")
        new_capacity = min(self.max_tokens, -(-needed // GROWTH_BLOCK) * GROWTH_BLOCK)
        keys_of: list[np.ndarray] = [np.empty(0)] * self.n_layer
        values_of: list[np.ndarray] = [np.empty(0)] * self.n_layer
        blocks = {}
        runs = -(-new_capacity // KEYS_WHOLE) * (KEYS_WHOLE // RUN)  # whole key blocks: attention reads them so
        for (n_kv, d, dv), members in self._groups.items():
            keys = mapped_block((len(members), n_kv, runs, d, RUN), self.dtype)
            values = mapped_block((len(members), n_kv, new_capacity, dv), self.dtype)
            old = self._blocks.get((n_kv, d, dv))
            for index, layer in enumerate(members):
                if old is not None:  # copy the valid prefix, giving back each old layer once copied
                    held = self.released if self.windows[layer] else 0  # released pages stay unwritten
                    keys[index, :, held // RUN:-(-self.length // RUN)] = \
                        self.keys[layer][:, held // RUN:-(-self.length // RUN)]
                    values[index, :, held:self.length] = self.values[layer][:, held:self.length]
                    for block in old:
                        release_pages(block, index)
                keys_of[layer], values_of[layer] = keys[index], values[index]
            blocks[(n_kv, d, dv)] = keys, values
        self._blocks = blocks
        self.keys, self.values = keys_of, values_of
        self.capacity = new_capacity
        self.written = self.length  # the new storage holds the valid prefix, nothing past it

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more tokens before a forward pass writes them."""
        if self.length + n_new > self.capacity:
            self._grow(self.length + n_new)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store this step's k/v [T, K, d] after the valid prefix.

        ``length`` moves only in ``commit`` so every layer writes at the same offset.
        """
        start, end = self.length, self.length + k.shape[0]
        self.put_key_rows(layer, start, k.transpose(1, 0, 2))
        self.values[layer][:, start:end] = v.transpose(1, 0, 2)

    def key_rows(self, layer: int, start: int, end: int) -> np.ndarray:
        """A copy of positions [start, end) of a layer's keys as rows [K, n, d]."""
        return keys_of_runs(self.keys[layer], start, end)

    def put_key_rows(self, layer: int, start: int, rows: np.ndarray) -> None:
        """Write rows [K, n, d] at positions start.. of a layer's keys (the runs they fall in
        keep their other positions)."""
        end = start + rows.shape[1]
        first, last = start // RUN, -(-end // RUN)
        if start % RUN or end % RUN:  # part runs at the ends: what they hold besides stays
            whole = self.key_rows(layer, first * RUN, last * RUN)
            whole[:, start - first * RUN:end - first * RUN] = rows
            rows = whole
        n_kv, _, d = rows.shape
        self.keys[layer][:, first:last] = rows.reshape(n_kv, last - first, RUN, d).transpose(0, 1, 3, 2)

    def store_and_attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                         window: int, out: np.ndarray, softcap: float = 0.0) -> np.ndarray:
        """``write`` and attention over the result in one compiled call (``attention.store_and_attend``):
        q [T, H, d], k [T, K, d], v [T, K, dv] float32, C-ordered; out [T, H*dv]; window and
        softcap 0 for none."""
        keys, values = self.kernel_arrays(layer)
        return attention.store_and_attend(q, k, v, keys, values, self.length, np.float32(scale), window,
                                          np.float32(softcap), out, self.prompt_rows(q.shape[0]),
                                          attention.task_addresses(values.dtype))

    def prompt_rows(self, n_tokens: int) -> bool:
        """Whether the next ``n_tokens`` positions are all a prompt's (below ``prompt_end``): the
        compiled attention takes such rows through the tile unit where it has one."""
        return self.length + n_tokens <= self.prompt_end

    def kernel_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """A layer's keys and values as the compiled attention reads them (``kernel_view``)."""
        return kernel_view(self.keys[layer]), kernel_view(self.values[layer])

    def commit(self, token_ids: list[int]) -> None:
        self.length += len(token_ids)
        self.written = max(self.written, self.length)
        self.tokens.extend(int(t) for t in token_ids)
        if self.snapshot_every and self.recurrent and self.length % self.snapshot_every == 0:
            self.snapshots[self.length] = self.copy_recurrent()
        if self.reach:
            self._release_behind()

    def _release_behind(self) -> None:
        """Give back the sliding layers' pages of positions no later step reads (a window and a
        key block behind the end, or behind ``resumable_at``), and not yet spilled ones while a
        kvstore waits for them."""
        target = self.length - self.reach
        if self.resumable_at:
            target = min(target, self.resumable_at - self.reach)
        if self.spilled is not None:
            target = min(target, self.spilled)
        if target - self.released < RELEASE_STEP:
            return
        for shape, (keys, values) in self._blocks.items():
            for index, layer in enumerate(self._groups[shape]):
                if self.windows[layer]:  # from 0: pages a step's edges left are whole now
                    release_positions(keys, index, 0, target // RUN)  # whole runs
                    release_positions(values, index, 0, target)
        self.released = target

    def continues_from(self, length: int) -> bool:
        """Whether a sequence can go on from its first ``length`` positions here: every sliding
        layer still holds the window before them (always, until positions are released)."""
        return length >= self.length or self.released == 0 or length >= self.released + self.reach

    def copy_recurrent(self) -> dict[int, list[np.ndarray]]:
        return {layer: [state.copy() for state in states] for layer, states in self.recurrent.items()}

    def checkpoint(self) -> dict[int, list[np.ndarray]] | None:
        """What a pass that fails part-way cannot undo by itself: recurrent states are moved on
        in place, layer by layer (K/V written past ``length`` are never committed). None where
        there is nothing to keep."""
        return self.copy_recurrent() if self.recurrent else None

    def roll_back(self, checkpoint: dict[int, list[np.ndarray]] | None) -> None:
        """Undo a failed pass: the states of ``checkpoint``; without one, states the pass began
        from nothing are dropped again."""
        if checkpoint is not None:
            self.recurrent = checkpoint
        elif not self.rewindable:
            self.recurrent.clear()

    def rewind(self, length: int, states: dict[int, list[np.ndarray]] | None) -> None:
        """Go back to the first ``length`` tokens after a pass that read more (drafts that did not
        stand). Recurrent states cannot be cut back: ``states`` are those held at ``length``,
        kept before the pass (``checkpoint``), and the caller reads again what it keeps after."""
        if self.rewindable:
            self.truncate(length)
            return
        self.recurrent = states if states is not None else {}
        self.length = length
        if self.spilled is not None:
            self.spilled = min(self.spilled, length)
        for held in [at for at in self.snapshots if at > length]:
            del self.snapshots[held]
        del self.tokens[length:]

    def truncate(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (they stay valid). Where the
        cache cannot continue from there (recurrent states, released windows), it keeps nothing."""
        if not self.rewindable and length < self.length:
            length = 0  # the states hold every token read: nothing shorter can be kept
        if not self.continues_from(length):
            length = 0
        if length == 0:
            self.recurrent.clear()
            self.released = 0  # the positions will be written again
        self.length = min(self.length, length)
        if self.spilled is not None:
            self.spilled = min(self.spilled, self.length)
        for held in [at for at in self.snapshots if at > self.length]:
            del self.snapshots[held]
        del self.tokens[self.length:]

    def clear(self) -> None:
        """Hold nothing and give the storage back to the system (it grows again when written)."""
        self.truncate(0)
        self.snapshots.clear()
        self._blocks = {}
        self.keys, self.values = [], []
        self.capacity = self.written = 0
        if self.spilled is not None:
            self.spilled = 0

    @property
    def resident_bytes(self) -> int:
        """What the storage's pages hold now: every position written since it was made (a
        truncated cache keeps its pages until they are written again), windows for sliding layers."""
        return self.full_bytes(self.written)

    def common_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids this cache already holds (in a cache that is not
        rewindable, all it holds or none)."""
        if not self.rewindable:
            held = len(self.tokens)
            return held if token_ids[:held] == self.tokens and len(token_ids) >= held else 0
        limit = min(len(self.tokens), len(token_ids))
        if limit == 0:
            return 0
        held = np.asarray(self.tokens[:limit])
        wanted = np.asarray(token_ids[:limit])
        mismatch = np.nonzero(held != wanted)[0]
        shared = int(mismatch[0]) if mismatch.size else limit
        return shared if self.continues_from(shared) else 0

    def chunk_shapes(self, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes ``export`` gives ``count`` positions: [L, K, n, d] and [L, K, n, dv] when
        every layer has one shape, else each layer's [K, n, d] flattened in turn."""
        if self.uniform:
            n_kv, d, dv = self.geometry[0]
            return (self.n_layer, n_kv, count, d), (self.n_layer, n_kv, count, dv)
        return ((sum(k * d for k, d, _ in self.geometry) * count,),
                (sum(k * dv for k, _, dv in self.geometry) * count,))

    def export(self, start: int, count: int, into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copies of positions [start, start+count) of every layer, in the cache's dtype, in
        the shapes of ``chunk_shapes``: the keys and then the values in one buffer, so a writer
        can store both without joining them (``KVChunk.encode``). The buffer is ``into`` (bytes,
        ``export_bytes(count)`` of them) where one is given: a fresh one of tens of MiB costs as
        long in page faults as the copy itself."""
        end = start + count
        if end > self.length:
            raise ValueError(f"positions up to {end} asked for, {self.length} held")
        if start < self.released:
            raise ValueError(f"positions from {start} asked for; the sliding layers hold them from {self.released}")
        k_shape, v_shape = self.chunk_shapes(count)
        k_size = int(np.prod(k_shape))
        dtype = self.keys[0].dtype
        if into is None:
            both = np.empty(k_size + int(np.prod(v_shape)), dtype=dtype)
        else:
            both = into[:self.export_bytes(count)].view(dtype)
        keys, values = both[:k_size].reshape(k_shape), both[k_size:].reshape(v_shape)
        key_rows = [self.key_rows(layer, start, end) for layer in range(self.n_layer)]
        if self.uniform:
            np.stack(key_rows, out=keys)
            np.stack([v[:, start:end] for v in self.values], out=values)
        else:
            np.concatenate([k.ravel() for k in key_rows], out=keys)
            np.concatenate([v[:, start:end].ravel() for v in self.values], out=values)
        return keys, values

    def export_bytes(self, count: int) -> int:
        """The bytes ``export`` of ``count`` positions fills."""
        return sum(int(np.prod(shape)) for shape in self.chunk_shapes(count)) * self.keys[0].dtype.itemsize

    def restore(self, start: int, keys: np.ndarray, values: np.ndarray, token_ids: list[int]) -> None:
        """Put positions [start, start+n) back from ``export``-shaped arrays; they become valid
        and everything after them is forgotten."""
        count = len(token_ids)
        if start > self.length or (keys.shape, values.shape) != self.chunk_shapes(count):
            raise ValueError("a restored run must continue the valid prefix, one id per position")
        self.truncate(start)
        self.reserve(count)
        k_at = v_at = 0
        for layer, (n_kv, d, dv) in enumerate(self.geometry):
            if self.uniform:
                k_part, v_part = keys[layer], values[layer]
            else:
                k_part = keys[k_at:k_at + n_kv * count * d].reshape(n_kv, count, d)
                v_part = values[v_at:v_at + n_kv * count * dv].reshape(n_kv, count, dv)
                k_at, v_at = k_at + k_part.size, v_at + v_part.size
            self.put_key_rows(layer, start, k_part)
            self.values[layer][:, start:start + count] = v_part
        self.commit(token_ids)

    def copy_prefix(self, other: "KVCache", count: int) -> None:
        """Hold what ``other`` holds at positions [0, count), and nothing after (all of it, in a
        cache that is not rewindable)."""
        if not other.rewindable and count != other.length:
            raise ValueError("a cache with recurrent state is copied whole or not at all")
        held = other.released
        other.released = 0  # a fork copies what it can: positions the other gave back come as zeros
        try:
            keys, values = other.export(0, count)
        finally:
            other.released = held
        self.restore(0, keys, values, other.tokens[:count])
        self.released, self.spilled = held, other.spilled  # and it must not spill them either
        self.recurrent = other.copy_recurrent()

    def full_bytes(self, n_tokens: int) -> int:
        """What the cache holds at ``n_tokens`` positions: its sliding layers only a window of
        them (and the steps before they are given back)."""
        held = 0
        for (n_kv, d, dv), window in zip(self.geometry, self.windows):
            positions = min(n_tokens, window + READ_MARGIN + RELEASE_STEP) if window else n_tokens
            held += n_kv * (d + dv) * positions
        return held * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return sum(k * (d + dv) for k, d, dv in self.geometry) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def key_runs(keys: np.ndarray) -> np.ndarray:
    """Keys [K, L, d] as the key cache holds them: [K, runs, d, RUN], run r holding positions
    rRUN .. rRUN + RUN - 1 dim by dim, as many runs as whole key blocks of attention take
    (zeros past L)."""
    n_kv, n_keys, d = keys.shape
    runs = -(-max(n_keys, 1) // KEYS_WHOLE) * (KEYS_WHOLE // RUN)
    padded = np.zeros((n_kv, runs * RUN, d), dtype=keys.dtype)
    padded[:, :n_keys] = keys
    return np.ascontiguousarray(padded.reshape(n_kv, runs, RUN, d).transpose(0, 1, 3, 2))


def keys_of_runs(runs: np.ndarray, start: int, end: int) -> np.ndarray:
    """Positions [start, end) of keys held in runs [K, runs, d, RUN], as rows [K, n, d] (a copy)."""
    first, last = start // RUN, -(-end // RUN)
    n_kv, _, d, _ = runs.shape
    rows = runs[:, first:last].transpose(0, 1, 3, 2).copy().reshape(n_kv, (last - first) * RUN, d)
    return rows[:, start - first * RUN:end - first * RUN]


def kernel_view(a: np.ndarray) -> np.ndarray:
    """A cache array as the compiled attention reads it: float32, or the bits of f16 as uint16."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def mapped_block(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array in an anonymous mapping of its own (pages become resident as
    they are written; the mapping goes when the array does)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    # private: pages given back (release_pages) are freed and read as zeros again; a shared
    # anonymous mapping would keep them in the system's shared memory
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    return np.frombuffer(region, dtype=dtype).reshape(shape)


def release_positions(block: np.ndarray, index: int, start: int, end: int) -> None:
    """Give back the whole pages of rows [start, end) of layer ``index`` of a block
    [layers, K, rows, ...] (positions of values, runs of keys), head by head."""
    region = _mapping_of(block)
    if region is None:
        return
    heads, capacity = block.shape[1], block.shape[2]
    row = int(np.prod(block.shape[3:])) * block.itemsize
    for head in range(heads):
        base = ((index * heads + head) * capacity) * row
        first = -(-(base + start * row) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (base + end * row) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            region.madvise(mmap.MADV_DONTNEED, first, last - first)


def _mapping_of(block: np.ndarray) -> mmap.mmap | None:
    """The anonymous mapping under a ``mapped_block`` (None where the platform cannot advise)."""
    region = block
    while isinstance(region, np.ndarray):
        region = region.base
    region = region.obj if isinstance(region, memoryview) else region
    return region if isinstance(region, mmap.mmap) and hasattr(region, "madvise") else None


def release_pages(block: np.ndarray, index: int) -> None:
    """Give back the whole pages of ``block[index]`` (a ``mapped_block``): they read as zeros
    afterwards. Where the platform cannot, nothing happens."""
    region = _mapping_of(block)
    if region is None:
        return
    size = block[index].nbytes
    start = -(-index * size // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (index + 1) * size // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        region.madvise(mmap.MADV_DONTNEED, start, end - start)
