"""The kvstore: spilled KV chunks kept outside the worker, in Redis or in a directory.

Both backends keep two records per chunk: the data, then a small metadata record written
after it. A chunk counts as present only when its metadata exists; a read that finds metadata
without data (evicted, half-written) deletes the metadata and reports a miss. Values carry
their shapes, dtype and a checksum, checked on every read.

Everything here is a cache: a backend that fails (Redis down or full, a disk error, a
corrupt file) logs the problem and answers "miss"; callers never see an exception.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
import numpy as np

log = logging.getLogger("lmserve.kvstore")


@dataclass(frozen=True)
class KVChunk:
    keys: np.ndarray  # [n_layer, K, chunk, d] float16 or float32, as the cache holds them
    values: np.ndarray  # [n_layer, K, chunk, dv] of the same type

    def encode(self) -> tuple[bytes, bytes]:
        """(data, metadata) records."""
        keys = np.ascontiguousarray(self.keys)
        values = np.ascontiguousarray(self.values, dtype=keys.dtype)
        data = keys.tobytes() + values.tobytes()
        meta = msgpack.packb({"k": list(keys.shape), "v": list(values.shape), "dtype": keys.dtype.name,
                              "bytes": len(data), "crc": zlib.crc32(data)})
        return data, meta

    @classmethod
    def decode(cls, data: bytes, meta: bytes, k_shape: tuple[int, ...], v_shape: tuple[int, ...],
               dtype: str) -> "KVChunk":
        """Rebuild a chunk, insisting on the geometry and type the caller expects; ValueError if not."""
        info = msgpack.unpackb(meta)
        if tuple(info["k"]) != k_shape or tuple(info["v"]) != v_shape or info["dtype"] != dtype:
            raise ValueError(f"chunk holds {info['k']}/{info['v']} {info['dtype']}, "
                             f"expected {k_shape}/{v_shape} {dtype}")
        if len(data) != info["bytes"] or zlib.crc32(data) != info["crc"]:
            raise ValueError("chunk data does not match its checksum")
        item = np.dtype(dtype)
        count = int(np.prod(k_shape))
        keys = np.frombuffer(data, dtype=item, count=count).reshape(k_shape)
        values = np.frombuffer(data, dtype=item, offset=count * item.itemsize).reshape(v_shape)
        return cls(keys, values)


@dataclass
class StateRecord:
    """A recurrent model's per-layer states (linear attention's convolution window and delta-rule
    state) as they stood at the end of a KV chunk, kept beside it: restoring the chunks up to
    there restores the sequence only with them."""

    states: dict[int, list[np.ndarray]]  # layer -> its arrays, float32

    def encode(self) -> tuple[bytes, bytes]:
        arrays = [(layer, np.ascontiguousarray(a, dtype=np.float32))
                  for layer, group in sorted(self.states.items()) for a in group]
        data = b"".join(a.tobytes() for _, a in arrays)
        meta = msgpack.packb({"arrays": [[layer, list(a.shape)] for layer, a in arrays], "bytes": len(data),
                              "crc": zlib.crc32(data)})
        return data, meta

    @classmethod
    def decode(cls, data: bytes, meta: bytes) -> "StateRecord":
        """ValueError when the record does not match its checksum."""
        info = msgpack.unpackb(meta)
        if len(data) != info["bytes"] or zlib.crc32(data) != info["crc"]:
            raise ValueError("state data does not match its checksum")
        states: dict[int, list[np.ndarray]] = {}
        offset = 0
        for layer, shape in info["arrays"]:
            count = int(np.prod(shape))
            states.setdefault(int(layer), []).append(
                np.frombuffer(data, dtype=np.float32, count=count, offset=offset).reshape(shape).copy())
            offset += count * 4
        return cls(states)


class KVStore(Protocol):
    def present(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first on, are stored (stops at the first miss)."""

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        """(data, metadata) of a chunk, or None."""

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        """Store a chunk: data first, metadata last."""

    def delete(self, key: str) -> None:
        """Forget a chunk (its metadata and data)."""

    def describe(self) -> str: ...


class RedisStore:
    """Chunks as two Redis keys, ``<key>:data`` and ``<key>:meta``.

    After a connection failure the store stays quiet (answers misses at once) for a short
    back-off, so a dead Redis costs one timeout, not one per request.
    """

    BACKOFF_SECONDS = 5.0

    def __init__(self, url: str, timeout: float = 1.0):
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._quiet_until = 0.0

    def describe(self) -> str:
        return f"redis {self.url}"

    def _guard(self, what: str, action, default):
        now = time.monotonic()
        if now < self._quiet_until:
            return default
        try:
            return action()
        except Exception as exc:  # connection refused, timeouts, OOM "command not allowed"…
            log.warning("kvstore %s failed (%s: %s); treating it as a miss", what, type(exc).__name__, exc)
            self._quiet_until = now + self.BACKOFF_SECONDS
            return default

    def present(self, keys: list[str]) -> int:
        if not keys:
            return 0

        def count() -> int:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key + ":meta")
            found = 0
            for hit in pipe.execute():
                if not hit:
                    break
                found += 1
            return found
        return self._guard("lookup", count, 0)

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        def fetch():
            meta, data = self.client.mget([key + ":meta", key + ":data"])
            if meta is None:
                return None
            if data is None:
                self.client.delete(key + ":meta")  # the data was evicted: the record lies
                return None
            return data, meta
        return self._guard("read", fetch, None)

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        def store():
            self.client.set(key + ":data", data)
            self.client.set(key + ":meta", meta)
        self._guard("write", store, None)

    def delete(self, key: str) -> None:
        self._guard("delete", lambda: self.client.delete(key + ":meta", key + ":data"), None)


class DirectoryStore:
    """Chunks as files ``<dir>/<k[:2]>/<key>.data`` and ``.meta``, bounded by a byte budget.

    When the budget is exceeded the least recently used chunks (by file time; reads touch it)
    are removed. Writes go through a temporary name and a rename, so a crash never leaves a
    half-written record under a real name.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._used = sum(p.stat().st_size for p in self.root.glob("*/*.data"))

    def describe(self) -> str:
        return f"directory {self.root} (budget {self.max_bytes / 2**20:.0f} MiB)"

    def files(self, key: str) -> tuple[Path, Path]:
        """Where a chunk's data and metadata are (or would be) kept."""
        name = key.rsplit(":", 1)[-1]
        folder = self.root / name[:2]
        return folder / f"{name}.data", folder / f"{name}.meta"

    def present(self, keys: list[str]) -> int:
        found = 0
        for key in keys:
            if not self.files(key)[1].exists():
                break
            found += 1
        return found

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        data_path, meta_path = self.files(key)
        try:
            meta = meta_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kvstore read of %s failed: %s; treating it as a miss", meta_path, exc)
            return None
        try:
            data = data_path.read_bytes()
            os.utime(data_path)  # recently used: evicted last
        except FileNotFoundError:
            meta_path.unlink(missing_ok=True)
            return None
        except OSError as exc:
            log.warning("kvstore read of %s failed: %s; treating it as a miss", data_path, exc)
            return None
        return data, meta

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        data_path, meta_path = self.files(key)
        try:
            data_path.parent.mkdir(exist_ok=True)
            for path, blob in ((data_path, data), (meta_path, meta)):
                # a name of this process's own: workers sharing the directory may write one chunk at once
                partial = path.with_suffix(f"{path.suffix}.{os.getpid()}.partial")
                partial.write_bytes(blob)
                os.replace(partial, path)
        except OSError as exc:
            log.warning("kvstore write of %s failed: %s; the chunk is not kept", data_path, exc)
            return
        with self._lock:
            self._used += len(data)
            if self._used > self.max_bytes:
                self._evict()

    def delete(self, key: str) -> None:
        data_path, meta_path = self.files(key)
        meta_path.unlink(missing_ok=True)
        try:
            size = data_path.stat().st_size
            data_path.unlink()
            with self._lock:
                self._used -= size
        except FileNotFoundError:
            pass

    def _evict(self) -> None:
        files = []
        for path in self.root.glob("*/*.data"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        used = sum(size for _, size, _ in files)
        target = self.max_bytes * 0.9  # some headroom, so eviction does not run on every write
        for _, size, path in files:
            if used <= target:
                break
            path.with_suffix(".meta").unlink(missing_ok=True)  # metadata first: never a lying record
            path.unlink(missing_ok=True)
            used -= size
        self._used = used


def open_store(redis_url: str | None = None, directory: str | None = None,
               max_bytes: int = 4 << 30) -> KVStore | None:
    if redis_url:
        return RedisStore(redis_url)
    if directory:
        return DirectoryStore(directory, max_bytes)
    return None
