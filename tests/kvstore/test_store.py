"""The two kvstore backends: real Redis and a directory, same contract, failures are misses; and
nothing read back is trusted: a record is sealed with the store secret, sized by its metadata,
and its values checked."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import free_port

from kvstore.chunks import chunk_keys
from kvstore.store import VALUE_LIMIT, DirectoryStore, KVChunk, RedisStore, SealedStore, StateRecord

SECRET = b"a store secret of the workers, 32"

K_SHAPE, V_SHAPE = (2, 3, 4, 8), (2, 3, 4, 8)


def _chunk(seed: int, dtype: str = "float16") -> KVChunk:
    rng = np.random.default_rng(seed)
    return KVChunk(rng.standard_normal(K_SHAPE).astype(dtype), rng.standard_normal(V_SHAPE).astype(dtype))


@pytest.fixture(params=["redis", "directory"])
def store(request, start_redis, tmp_path):
    if request.param == "redis":
        return RedisStore(start_redis().url)
    return DirectoryStore(tmp_path / "kv", max_bytes=1 << 30)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_and_consecutive_presence(store, dtype):
    keys = [f"lmserve:kv:{i:040x}" for i in range(4)]
    for i in (0, 1, 3):
        store.put(keys[i], *_chunk(i, dtype).encode())
    assert store.present(keys) == 2  # stops at the first miss
    data, meta = store.get(keys[1])
    assert len(data) == 2 * np.prod(K_SHAPE) * np.dtype(dtype).itemsize
    chunk = KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, dtype)
    assert chunk.keys.dtype == chunk.values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(chunk.keys, _chunk(1, dtype).keys)
    np.testing.assert_array_equal(chunk.values, _chunk(1, dtype).values)
    assert store.get(keys[2]) is None


def test_metadata_without_data_counts_as_absent(store, tmp_path):
    key = "lmserve:kv:" + "ab" * 20
    store.put(key, *_chunk(7).encode())
    if isinstance(store, RedisStore):
        store.client.delete(key + ":data")  # evicted by Redis
    else:
        store.files(key)[0].unlink()
    assert store.get(key) is None
    assert store.present([key]) == 0  # the lying record is gone


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_chunk_encodes_as_its_keys_bytes_then_its_values(dtype):
    """Whether the values follow the keys in one buffer (a cache's export: stored as a view,
    no copy) or lie apart (joined), the data is the same bytes."""
    apart = _chunk(5, dtype)
    both = np.concatenate([apart.keys.ravel(), apart.values.ravel()])
    joined = KVChunk(both[:apart.keys.size].reshape(K_SHAPE), both[apart.keys.size:].reshape(V_SHAPE), both)
    expected = apart.keys.tobytes() + apart.values.tobytes()
    for chunk in (apart, joined):
        data, meta = chunk.encode()
        assert bytes(data) == expected and len(data) == len(expected)
        again = KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, dtype)
        np.testing.assert_array_equal(again.keys, apart.keys)
        np.testing.assert_array_equal(again.values, apart.values)
    assert joined.encode()[0].obj is both  # the buffer itself, not a copy


def test_wrong_geometry_or_truncated_data_is_refused():
    data, meta = _chunk(3).encode()
    with pytest.raises(ValueError, match="expected"):
        KVChunk.decode(data, meta, (2, 3, 4, 16), V_SHAPE, "float16")
    with pytest.raises(ValueError, match="expected .* float32"):  # a cache of the other KV type
        KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, "float32")
    with pytest.raises(ValueError, match="bytes"):
        KVChunk.decode(data[:-2], meta, K_SHAPE, V_SHAPE, "float16")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 60000.0, -VALUE_LIMIT * 1.5])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_values_no_model_writes_are_refused(value, dtype):
    chunk = _chunk(4, dtype)
    chunk.values[1, 2, 3, 4] = value
    with pytest.raises(ValueError, match="not finite or beyond"):
        KVChunk.decode(*chunk.encode(), K_SHAPE, V_SHAPE, dtype)
    states = StateRecord({0: [np.zeros((2, 3), np.float32), np.full(4, value, np.float32)]})
    with pytest.raises(ValueError, match="not finite or beyond"):
        StateRecord.decode(*states.encode())
    chunk.values[1, 2, 3, 4] = VALUE_LIMIT  # the limit itself is a value
    KVChunk.decode(*chunk.encode(), K_SHAPE, V_SHAPE, dtype)


def test_sealed_records_round_trip_and_reject_what_the_secret_did_not_seal(store):
    sealed = SealedStore(store, SECRET)
    keys = [f"lmserve:kv:{i:040x}" for i in range(40, 45)]
    chunks = [_chunk(i) for i in range(5)]
    for key, chunk in zip(keys, chunks):
        sealed.put(key, *chunk.encode())
    data, meta = sealed.get(keys[0])
    np.testing.assert_array_equal(KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, "float16").keys, chunks[0].keys)

    def raw(key):  # what the attacker sees and writes: the backend's records, tags and all
        return store.get(key)

    # 1. one value changed in place, the rest of the record (its tag) kept
    data, meta = raw(keys[1])
    altered = np.frombuffer(data, np.float16).copy()
    altered[5] = 60000
    store.put(keys[1], altered.tobytes(), meta)
    # 2. a record forged whole, well-formed, without the secret (a recomputed checksum would pass)
    poisoned = _chunk(1)
    poisoned.keys[:] = 60000
    store.put(keys[2], *poisoned.encode())
    # 3. two genuine records swapped between their names
    (data3, meta3), (data4, meta4) = raw(keys[3]), raw(keys[4])
    store.put(keys[3], data4, meta4)
    store.put(keys[4], data3, meta3)
    rejected = sealed.rejections.count
    for key in keys[1:]:
        assert sealed.get(key) is None
        assert store.present([key]) == 0  # dropped: recomputed and written anew next time
    assert sealed.rejections.count - rejected == 4
    # a store sealed with another secret trusts none of them
    assert SealedStore(store, b"another secret, 16+ bytes").get(keys[0]) is None
    assert sealed.get(keys[0]) is None  # the failed read dropped it


def test_a_rejection_is_counted_for_the_metrics_and_logged_at_most_once_a_minute(store, caplog):
    counted = []
    sealed = SealedStore(store, SECRET)
    sealed.rejections.on_reject = lambda: counted.append(1)
    for i in range(3):
        key = f"lmserve:kv:{i:040x}"
        store.put(key, *_chunk(i).encode())  # never sealed
        with caplog.at_level("WARNING", logger="lmserve.kvstore"):
            assert sealed.get(key) is None
    assert len(counted) == 3
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1


def test_redis_down_is_a_miss_not_an_error(start_redis):
    server = start_redis()
    store = RedisStore(server.url, timeout=0.5)
    key = "lmserve:kv:" + "ef" * 20
    store.put(key, *_chunk(1).encode())
    server.kill()
    assert store.present([key]) == 0
    assert store.get(key) is None
    store.put(key, *_chunk(2).encode())  # logged, dropped


def test_directory_budget_evicts_the_oldest(tmp_path):
    one = len(_chunk(0).encode()[0])
    store = DirectoryStore(tmp_path / "kv", max_bytes=3 * one)
    keys = [f"lmserve:kv:{i:040x}" for i in range(5)]
    for i, key in enumerate(keys):
        store.put(key, *_chunk(i).encode())
    assert store.present(keys[-2:]) == 2
    assert store.present(keys[:1]) == 0
    assert sum(1 for _ in (tmp_path / "kv").glob("*/*.data")) <= 3


def test_directory_file_of_another_size_than_its_metadata_is_a_miss(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 30)
    key = "lmserve:kv:" + "12" * 20
    store.put(key, *_chunk(5).encode())
    store.files(key)[0].write_bytes(b"garbage")
    assert store.get(key) is None
    assert store.rejections.count == 1 and store.present([key]) == 0


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("replacement", ["dev-zero", "fifo", "huge-sparse", "huge-metadata"])
def test_directory_reads_only_regular_files_of_the_stated_size(tmp_path, replacement):
    """A chunk file replaced by a symlink to /dev/zero once grew a worker to 22 GB; a FIFO hung it."""
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 40, record_limit=1 << 20)
    key = "lmserve:kv:" + "34" * 20
    store.put(key, *_chunk(6).encode())
    data_path, meta_path = store.files(key)
    if replacement == "dev-zero":
        data_path.unlink()
        data_path.symlink_to("/dev/zero")
    elif replacement == "fifo":
        data_path.unlink()
        os.mkfifo(data_path)
    elif replacement == "huge-sparse":  # a regular file, and its metadata rewritten to match
        with open(data_path, "r+b") as file:
            file.truncate(8 << 30)
        meta = meta_path.read_bytes()
        meta_path.write_bytes((8 << 30).to_bytes(8, "little") + meta[8:])
    else:
        with open(meta_path, "r+b") as file:
            file.truncate(8 << 30)
    before = _peak_rss()
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(store.get(key)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the read blocked"
    assert outcome == [None]
    assert _peak_rss() - before < 64 << 20
    assert store.rejections.count == 1
    assert not data_path.exists() and not data_path.is_symlink()  # dropped


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_directory_refuses_a_file_another_user_owns(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 30)
    key = "lmserve:kv:" + "56" * 20
    store.put(key, *_chunk(7).encode())
    os.chown(store.files(key)[0], 12345, 12345)
    assert store.get(key) is None and store.rejections.count == 1


def test_redis_record_larger_than_the_limit_or_its_metadata_is_a_miss(start_redis):
    store = RedisStore(start_redis().url, record_limit=1 << 16)
    key = "lmserve:kv:" + "78" * 20
    store.put(key, *_chunk(8).encode())
    store.client.setrange(key + ":data", 1 << 20, b"x")  # grown past the limit, metadata unchanged
    assert store.get(key) is None and store.rejections.count == 1
    big = KVChunk(np.zeros((2, 64, 64, 8), np.float16), np.zeros((2, 64, 64, 8), np.float16))
    store.put(key, *big.encode())  # well-formed, but above the limit
    assert store.get(key) is None and store.rejections.count == 2


def test_chunk_keys_chain_the_whole_prefix():
    a = chunk_keys("fp", list(range(1000)), 256)
    b = chunk_keys("fp", list(range(1000)), 256)
    assert len(a) == 3 and a == b
    changed = chunk_keys("fp", [7] + list(range(1, 1000)), 256)
    assert all(x != y for x, y in zip(a, changed))  # the first token changes every later chunk
    assert chunk_keys("other-model", list(range(1000)), 256)[0] != a[0]
    assert chunk_keys("fp", list(range(1000)), 256, prefix_ids=("cart1",))[0] != a[0]
    assert chunk_keys("fp", list(range(512)), 256) == a[:2]


def test_redis_with_a_password_from_the_url_or_apart(start_redis):
    server = start_redis(password="a-redis-password")
    key = "lmserve:kv:" + "9a" * 20
    outsider = RedisStore(server.url)  # no password: every command refused, which is a miss
    outsider.put(key, *_chunk(9).encode())
    assert outsider.get(key) is None
    for store in (RedisStore(server.url, password="a-redis-password"),
                  RedisStore(server.url.replace("redis://", "redis://:a-redis-password@"))):
        store.put(key, *_chunk(9).encode())
        assert store.get(key) is not None
        assert "a-redis-password" not in store.describe()


def test_redis_over_tls(tmp_path):
    """``rediss://``: the store speaks TLS to a Redis that takes nothing else (Debian's
    redis-server, a certificate made here), with a password besides."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (Debian package openssl; .ci/run installs it)")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                               "--tls-cert-file", "cert.pem", "--tls-key-file", "key.pem", "--tls-ca-cert-file",
                               "cert.pem", "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
                               "--requirepass", "over-tls"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'cert.pem'}"
        store = RedisStore(url, password="over-tls", timeout=2.0)
        key = "lmserve:kv:" + "bc" * 20
        assert _pingable(store)
        store.put(key, *_chunk(10).encode())
        assert store.get(key) is not None
        plain = RedisStore(f"redis://127.0.0.1:{port}/0", password="over-tls")  # no TLS: nothing
        assert plain.get(key) is None
    finally:
        server.terminate()
        server.wait(10)


def _pingable(store: RedisStore) -> bool:
    """Whether the server answers within 20 s (it starts meanwhile)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            return bool(store.client.ping())
        except Exception:
            time.sleep(0.1)
    return False


def test_directory_never_follows_a_symlinked_folder(tmp_path):
    """A chunk folder replaced by a link to elsewhere: nothing is read, written or evicted there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.data").write_bytes(b"x" * 4096)
    store = DirectoryStore(tmp_path / "kv", max_bytes=3 * len(_chunk(0).encode()[0]))
    key = "lmserve:kv:" + "ee" * 20
    store.put(key, *_chunk(1).encode())
    folder = store.files(key)[0].parent
    for child in folder.iterdir():
        child.unlink()
    folder.rmdir()
    folder.symlink_to(outside, target_is_directory=True)
    assert store.get(key) is None and store.rejections.count == 1
    assert not folder.is_symlink()  # the link itself is dropped, never what it points at
    folder.symlink_to(outside, target_is_directory=True)
    store.put(key, *_chunk(2).encode())  # not written through the link
    assert sorted(p.name for p in outside.iterdir()) == ["precious.data"]
    for i in range(6):  # eviction passes over what is not its own
        store.put(f"lmserve:kv:{i:040x}", *_chunk(i).encode())
    assert (outside / "precious.data").read_bytes() == b"x" * 4096


def test_directory_odd_entries_are_misses_not_errors(tmp_path):
    root = tmp_path / "kv"
    key = "lmserve:kv:" + "dd" * 20
    store = DirectoryStore(root, max_bytes=3 * len(_chunk(0).encode()[0]))
    store.put(key, *_chunk(1).encode())
    data_path = store.files(key)[0]
    data_path.unlink()
    data_path.mkdir()  # a folder where the data file should be
    (root / "dd" / "dangling.data").symlink_to(tmp_path / "nowhere")
    assert store.get(key) is None
    DirectoryStore(root, max_bytes=1 << 30)  # a dangling link does not stop a worker from starting
    for i in range(6):
        store.put(f"lmserve:kv:{i:040x}", *_chunk(i).encode())  # nor does the folder stop eviction
    assert sum(1 for _ in root.glob("*/*.data")) <= 5


def test_a_planted_file_does_not_skew_the_directory_budget(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 30)
    key = "lmserve:kv:" + "cc" * 20
    store.put(key, *_chunk(1).encode())
    used = store.used
    with open(store.files(key)[0], "r+b") as file:
        file.truncate(1 << 40)  # sparse, 1 TiB: rejected and removed
    assert store.get(key) is None
    assert 0 <= store.used <= used
