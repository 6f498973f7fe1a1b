"""The kvstore: spilled KV chunks kept outside the worker, in Redis or in a directory.

Both backends keep two records per chunk: the data, then a small metadata record written
after it, which leads with the data's length. A chunk counts as present only when its metadata
exists; a read that finds metadata without data of that length (evicted, half-written, replaced)
deletes the metadata and reports a miss. A backend never reads more than the metadata states, nor
a record above its limit.

Nothing read back is trusted. ``SealedStore`` wraps a backend: every record carries a BLAKE2b
tag keyed by the store secret the workers share, over the record's name, metadata and data, so
a party that can write to Redis or to the directory can neither forge a record nor move one to
another name; a record whose tag fails is deleted and is a miss. Decoded values are checked
finite and within range besides.

Everything here is a cache: a backend that fails (Redis down or full, a disk error, a
corrupt file) logs the problem and answers "miss"; callers never see an exception.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack
import numpy as np

log = logging.getLogger("lmserve.kvstore")

# No key or value a model writes comes near this (SmolLM2-135M's largest is 24): a restored value
# beyond it was not written by a worker. Infinities and NaNs are refused the same way.
VALUE_LIMIT = 32768.0
META_LIMIT = 1 << 20  # bytes of a metadata record, ours are tens
LENGTH = struct.Struct("<Q")  # the data's length, leading every stored metadata record


def check_values(arrays: list[np.ndarray], what: str) -> None:
    """ValueError unless every value is finite and within ``VALUE_LIMIT``."""
    for array in arrays:
        if array.size and not np.all(np.abs(array) <= VALUE_LIMIT):  # NaN compares false
            raise ValueError(f"{what} holds values that are not finite or beyond ±{VALUE_LIMIT:g}")


@dataclass(frozen=True)
class KVChunk:
    keys: np.ndarray  # [n_layer, K, chunk, d] float16 or float32, as the cache holds them
    values: np.ndarray  # [n_layer, K, chunk, dv] of the same type
    buffer: np.ndarray | None = None  # the memory both are views of, where the writer may reuse it

    def encode(self) -> tuple[memoryview, bytes]:
        """(data, metadata) records. The data is the keys' bytes then the values': a view of the
        arrays' own memory where the values follow the keys in one buffer (``KVCache.export``),
        else a joined copy. A chunk is tens of MiB; copying it into bytes would hold the
        interpreter lock for as long as the copies take."""
        keys = np.ascontiguousarray(self.keys)
        values = np.ascontiguousarray(self.values, dtype=keys.dtype)
        if keys.base is not None and keys.base is values.base and keys.ctypes.data + keys.nbytes == values.ctypes.data:
            base = keys.base
            offset = keys.ctypes.data - base.ctypes.data
            data = memoryview(base).cast("B")[offset:offset + keys.nbytes + values.nbytes]
        else:
            data = memoryview(np.concatenate([keys.ravel(), values.ravel()])).cast("B")
        meta = msgpack.packb({"k": list(keys.shape), "v": list(values.shape), "dtype": keys.dtype.name,
                              "bytes": len(data)})
        return data, meta

    @classmethod
    def decode(cls, data: bytes, meta: bytes, k_shape: tuple[int, ...], v_shape: tuple[int, ...],
               dtype: str) -> "KVChunk":
        """Rebuild a chunk, insisting on the geometry and type the caller expects and on values a
        model can write; ValueError if not."""
        info = msgpack.unpackb(meta)
        if tuple(info["k"]) != k_shape or tuple(info["v"]) != v_shape or info["dtype"] != dtype:
            raise ValueError(f"chunk holds {info['k']}/{info['v']} {info['dtype']}, "
                             f"expected {k_shape}/{v_shape} {dtype}")
        item = np.dtype(dtype)
        count = int(np.prod(k_shape))
        if len(data) != info["bytes"] or len(data) != (count + int(np.prod(v_shape))) * item.itemsize:
            raise ValueError(f"chunk data is {len(data)} bytes, not the {info['bytes']} its metadata states")
        keys = np.frombuffer(data, dtype=item, count=count).reshape(k_shape)
        values = np.frombuffer(data, dtype=item, offset=count * item.itemsize).reshape(v_shape)
        check_values([keys, values], "chunk")
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
        meta = msgpack.packb({"arrays": [[layer, list(a.shape)] for layer, a in arrays], "bytes": len(data)})
        return data, meta

    @classmethod
    def decode(cls, data: bytes, meta: bytes) -> "StateRecord":
        """ValueError when the record's arrays do not fill its data exactly, or hold values no
        model writes."""
        info = msgpack.unpackb(meta)
        shapes = [(int(layer), [int(n) for n in shape]) for layer, shape in info["arrays"]]
        if len(data) != info["bytes"] or len(data) != 4 * sum(int(np.prod(shape)) for _, shape in shapes):
            raise ValueError(f"state data is {len(data)} bytes, not what its metadata states")
        states: dict[int, list[np.ndarray]] = {}
        offset = 0
        for layer, shape in shapes:
            count = int(np.prod(shape))
            states.setdefault(layer, []).append(
                np.frombuffer(data, dtype=np.float32, count=count, offset=offset).reshape(shape).copy())
            offset += count * 4
        check_values([a for group in states.values() for a in group], "state record")
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

    @property
    def rejections(self) -> Rejections:
        """Where records refused on reading are counted."""


class Rejections:
    """Records refused on reading (forged, moved, truncated, oversized, not a regular file):
    counted, reported to ``on_reject`` (the worker's metrics), and logged the first time and then
    at most once a minute, so a flood of bad records cannot flood the log."""

    LOG_INTERVAL = 60.0

    def __init__(self, on_reject: Callable[[], None] | None = None):
        self.count = 0
        self.on_reject = on_reject
        self._unlogged = 0
        self._logged_at = float("-inf")
        self._lock = threading.Lock()

    def report(self, key: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < self.LOG_INTERVAL:
                quiet = True
            else:
                quiet, unlogged = False, self._unlogged
                self._unlogged, self._logged_at = 0, now
        if self.on_reject is not None:
            self.on_reject()
        if not quiet:
            more = f" ({unlogged - 1} more since the last report)" if unlogged > 1 else ""
            log.warning("kvstore record %s refused: %s; it is dropped and its tokens recomputed%s",
                        key, reason, more)


def parse_length(meta: bytes) -> int:
    """The data length a stored metadata record leads with; ValueError when it has none."""
    if len(meta) < LENGTH.size:
        raise ValueError(f"metadata record of {len(meta)} bytes")
    return LENGTH.unpack_from(meta)[0]


class RedisStore:
    """Chunks as two Redis keys, ``<key>:data`` and ``<key>:meta``.

    The URL may carry a user and password (``redis://user:secret@host:6379/0``) and ask for TLS
    (``rediss://``); a password given apart (``password``) is used when the URL has none. After a
    connection failure the store stays quiet (answers misses at once) for a short back-off, so a
    dead Redis costs one timeout, not one per request.
    """

    BACKOFF_SECONDS = 5.0

    def __init__(self, url: str, timeout: float = 1.0, record_limit: int = 1 << 30,
                 password: str | None = None, rejections: Rejections | None = None):
        import redis

        self.url = url
        self._refused = redis.exceptions.ResponseError  # a command Redis will not run on that key
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if password and not redis.connection.parse_url(url).get("password"):
            options["password"] = password
        self.client = redis.Redis.from_url(url, **options)
        self.record_limit = record_limit
        self.rejections = rejections or Rejections()
        self._quiet_until = 0.0

    def describe(self) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        host = parts.hostname or ""
        where = f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "") + parts.path
        return f"redis {where}"  # never the password

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
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(key + ":meta").getrange(key + ":meta", 0, META_LIMIT - 1).strlen(key + ":data")
            try:
                meta_size, meta, data_size = pipe.execute()
            except self._refused as exc:  # a key of another type put in its place
                self.rejections.report(key, f"Redis refused to read it ({exc})")
                self.client.delete(key + ":meta", key + ":data")
                return None
            if not meta_size:
                return None
            if data_size == 0:
                self.client.delete(key + ":meta")  # the data was evicted: the record lies
                return None
            try:
                if meta_size > META_LIMIT:
                    raise ValueError(f"metadata of {meta_size} bytes")
                length = parse_length(meta)
                if length != data_size or length > self.record_limit:
                    raise ValueError(f"data of {data_size} bytes where its metadata states {length} "
                                     f"(at most {self.record_limit})")
            except ValueError as exc:
                self.rejections.report(key, str(exc))
                self.delete(key)
                return None
            data = self.client.getrange(key + ":data", 0, length - 1) if length else b""
            if len(data) != length:  # replaced since
                return None
            return data, meta[LENGTH.size:]
        return self._guard("read", fetch, None)

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        def store():
            # one transaction: two workers writing one chunk never leave one's data under the other's metadata
            pipe = self.client.pipeline(transaction=True)
            pipe.set(key + ":data", data).set(key + ":meta", LENGTH.pack(len(data)) + meta)
            pipe.execute()
        self._guard("write", store, None)

    def delete(self, key: str) -> None:
        self._guard("delete", lambda: self.client.delete(key + ":meta", key + ":data"), None)


class DirectoryStore:
    """Chunks as files ``<dir>/<k[:2]>/<key>.data`` and ``.meta``, bounded by a byte budget.

    When the budget is exceeded the least recently used chunks (by file time; reads touch it)
    are removed. Writes go through a temporary name and a rename, so a crash never leaves a
    half-written record under a real name. Nothing here follows a symlink: each folder is opened
    without following one, and every file is opened, renamed and removed relative to it; reads
    take only regular files this user owns, of the size the metadata states. Anything else found
    in the tree (a link, a FIFO, a device, a folder where a file should be) is a miss, never an
    error, and is counted nowhere in the budget.
    """

    FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def __init__(self, directory: str | os.PathLike, max_bytes: int, record_limit: int | None = None,
                 rejections: Rejections | None = None):
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.record_limit = min(record_limit or max_bytes, max_bytes)
        self.rejections = rejections or Rejections()
        self._lock = threading.Lock()
        self._used = sum(size for _, size, _, _ in self._data_files())

    def describe(self) -> str:
        return f"directory {self.root} (budget {self.max_bytes / 2**20:.0f} MiB)"

    @property
    def used(self) -> int:
        """Bytes of chunk data counted against the budget."""
        return self._used

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

    def _folder(self, key: str, create: bool = False) -> int:
        """A descriptor of the chunk's folder, opened without following a symlink; OSError
        (ELOOP, ENOTDIR, ENOENT) when it is not a real folder."""
        folder = self.files(key)[0].parent
        if create:
            try:
                os.mkdir(folder)
            except FileExistsError:
                pass
        return os.open(folder, self.FOLDER_FLAGS)

    @staticmethod
    def _read(folder: int, name: str, limit: int, exact: int | None = None) -> bytes:
        """A regular file of ours in ``folder``, of ``exact`` bytes (or at most ``limit``), read
        without following a symlink or waiting on a FIFO. FileNotFoundError when absent,
        ValueError when it is not such a file."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"{name} cannot be opened as a file ({exc.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{name} is not a regular file")
            if info.st_uid != os.geteuid():
                raise ValueError(f"{name} belongs to another user (uid {info.st_uid})")
            size = info.st_size
            if size > limit or (exact is not None and size != exact):
                wanted = f"the {exact} its metadata states" if exact is not None else f"at most {limit}"
                raise ValueError(f"{name} is {size} bytes, not {wanted}")
            parts, left = [], size
            while left:
                part = os.read(fd, min(left, 1 << 24))
                if not part:
                    raise ValueError(f"{name} shrank while being read")
                parts.append(part)
                left -= len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        data_path, meta_path = self.files(key)
        try:
            folder = self._folder(key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.rejections.report(key, f"its folder {data_path.parent.name} is not a folder ({exc.strerror})")
            self._drop_folder(data_path.parent)
            return None
        try:
            meta = self._read(folder, meta_path.name, META_LIMIT)
            length = parse_length(meta)
            if length > self.record_limit:
                raise ValueError(f"its metadata states {length} bytes of data, above the limit of "
                                 f"{self.record_limit}")
            data = self._read(folder, data_path.name, length, exact=length)
            os.utime(data_path.name, dir_fd=folder, follow_symlinks=False)  # recently used: evicted last
        except FileNotFoundError:
            self._unlink(folder, meta_path.name)  # metadata without data: the record lies
            return None
        except ValueError as exc:
            self.rejections.report(key, str(exc))
            self._remove(folder, key)
            return None
        except OSError as exc:
            log.warning("kvstore read of %s failed: %s; treating it as a miss", data_path, exc)
            return None
        finally:
            os.close(folder)
        return data, meta[LENGTH.size:]

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        data_path, meta_path = self.files(key)
        try:
            folder = self._folder(key, create=True)
        except OSError as exc:
            log.warning("kvstore folder of %s is unusable (%s); the chunk is not kept", data_path, exc)
            if not isinstance(exc, FileNotFoundError):
                self._drop_folder(data_path.parent)  # a link or a file in its place: the next write makes it anew
            return
        try:
            for name, blob in ((data_path.name, data), (meta_path.name, LENGTH.pack(len(data)) + meta)):
                # a name of this process's own: workers sharing the directory may write one chunk at once
                partial = f"{name}.{os.getpid()}.partial"
                self._unlink(folder, partial)  # never write through what someone put in its place
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=folder)
                with os.fdopen(fd, "wb") as file:
                    file.write(blob)
                os.replace(partial, name, src_dir_fd=folder, dst_dir_fd=folder)
        except OSError as exc:
            log.warning("kvstore write of %s failed: %s; the chunk is not kept", data_path, exc)
            return
        finally:
            os.close(folder)
        with self._lock:
            self._used += len(data)
            if self._used > self.max_bytes:
                self._evict()

    def delete(self, key: str) -> None:
        try:
            folder = self._folder(key)
        except OSError:
            return
        try:
            self._remove(folder, key)
        finally:
            os.close(folder)

    def _remove(self, folder: int, key: str) -> None:
        """Remove a chunk's two files from its open folder; only a regular file of ours counted
        against the budget gives its size back."""
        data_name, meta_name = (path.name for path in self.files(key))
        self._unlink(folder, meta_name)  # metadata first: never a lying record
        try:
            info = os.stat(data_name, dir_fd=folder, follow_symlinks=False)
        except OSError:
            return
        if self._unlink(folder, data_name) and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            with self._lock:
                self._used = max(0, self._used - min(info.st_size, self.record_limit))

    @staticmethod
    def _unlink(folder: int, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=folder)
            return True
        except OSError:  # absent, or a folder where a file should be: it stays a miss
            return False

    def _drop_folder(self, path: Path) -> None:
        """Remove a symlink or a file standing where a chunk folder should be (never what it points at)."""
        try:
            if not stat.S_ISDIR(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass

    def _data_files(self) -> list[tuple[float, int, int, str]]:
        """(time, size, folder name, file name) of every regular data file of ours in real folders."""
        files = []
        try:
            folders = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return files
        for name in folders:
            try:
                entries = list(os.scandir(self.root / name))
            except OSError:
                continue
            for entry in entries:
                if not entry.name.endswith(".data"):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    files.append((info.st_mtime, info.st_size, name, entry.name))
        return files

    def _evict(self) -> None:
        files = sorted(self._data_files())
        used = sum(size for _, size, _, _ in files)
        target = self.max_bytes * 0.9  # some headroom, so eviction does not run on every write
        for _, size, folder_name, data_name in files:
            if used <= target:
                break
            try:
                folder = os.open(self.root / folder_name, self.FOLDER_FLAGS)
            except OSError:
                continue
            try:
                self._unlink(folder, data_name.removesuffix(".data") + ".meta")  # metadata first
                self._unlink(folder, data_name)
            finally:
                os.close(folder)
            used -= size
        self._used = used


class SealedStore:
    """A backend whose records are authenticated: each metadata record ends with a BLAKE2b tag
    keyed by the store secret, over the record's name, its metadata and its data. A record whose
    tag is missing or wrong (forged, altered, or copied from another name) is deleted and read as
    a miss; so is one whose data the backend refused."""

    TAG_BYTES = 32

    def __init__(self, backend: KVStore, secret: bytes, rejections: Rejections | None = None):
        if len(secret) < 16:
            raise ValueError("a kvstore secret needs at least 16 bytes")
        self.backend = backend
        # the secret may be any length; BLAKE2b takes a key of at most 64 bytes
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"lmserve kv key").digest()
        self.rejections = rejections or getattr(backend, "rejections", None) or Rejections()

    def tag(self, key: str, data: bytes, meta: bytes) -> bytes:
        mac = hashlib.blake2b(key=self._key, digest_size=self.TAG_BYTES, person=b"lmserve kv")
        name = key.encode()
        mac.update(LENGTH.pack(len(name)) + name + LENGTH.pack(len(meta)) + meta + LENGTH.pack(len(data)))
        mac.update(data)
        return mac.digest()

    def describe(self) -> str:
        return self.backend.describe()

    def present(self, keys: list[str]) -> int:
        return self.backend.present(keys)

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        record = self.backend.get(key)
        if record is None:
            return None
        data, sealed = record
        meta, tag = sealed[:-self.TAG_BYTES], sealed[-self.TAG_BYTES:]
        if len(sealed) < self.TAG_BYTES or not hmac.compare_digest(tag, self.tag(key, data, meta)):
            self.rejections.report(key, "its tag does not match (written without the store secret, "
                                        "altered, or moved from another name)")
            self.backend.delete(key)
            return None
        return data, meta

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        self.backend.put(key, data, meta + self.tag(key, data, meta))

    def delete(self, key: str) -> None:
        self.backend.delete(key)


def open_store(redis_url: str | None = None, directory: str | None = None, max_bytes: int = 4 << 30,
               secret: bytes | None = None, record_limit: int = 1 << 30, password: str | None = None,
               on_reject: Callable[[], None] | None = None) -> KVStore | None:
    """The kvstore the flags name, sealed with ``secret`` (unsealed only without one: tests of
    the backends themselves)."""
    rejections = Rejections(on_reject)
    if redis_url:
        backend: KVStore = RedisStore(redis_url, record_limit=record_limit, password=password,
                                      rejections=rejections)
    elif directory:
        backend = DirectoryStore(directory, max_bytes, record_limit=record_limit, rejections=rejections)
    else:
        return None
    return SealedStore(backend, secret, rejections) if secret is not None else backend
