"""The two kvstore backends: real Redis and a directory, same contract, failures are misses."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.chunks import chunk_keys
from kvstore.store import DirectoryStore, KVChunk, RedisStore

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


def test_wrong_geometry_or_corrupt_data_is_refused(store):
    data, meta = _chunk(3).encode()
    with pytest.raises(ValueError, match="expected"):
        KVChunk.decode(data, meta, (2, 3, 4, 16), V_SHAPE, "float16")
    with pytest.raises(ValueError, match="expected .* float32"):  # a cache of the other KV type
        KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, "float32")
    damaged = bytearray(data)
    damaged[10] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        KVChunk.decode(bytes(damaged), meta, K_SHAPE, V_SHAPE, "float16")


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


def test_directory_corrupt_file_is_a_miss_upstream(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 30)
    key = "lmserve:kv:" + "12" * 20
    store.put(key, *_chunk(5).encode())
    store.files(key)[0].write_bytes(b"garbage")
    data, meta = store.get(key)
    with pytest.raises(ValueError):
        KVChunk.decode(data, meta, K_SHAPE, V_SHAPE, "float16")


def test_chunk_keys_chain_the_whole_prefix():
    a = chunk_keys("fp", list(range(1000)), 256)
    b = chunk_keys("fp", list(range(1000)), 256)
    assert len(a) == 3 and a == b
    changed = chunk_keys("fp", [7] + list(range(1, 1000)), 256)
    assert all(x != y for x, y in zip(a, changed))  # the first token changes every later chunk
    assert chunk_keys("other-model", list(range(1000)), 256)[0] != a[0]
    assert chunk_keys("fp", list(range(1000)), 256, prefix_ids=("cart1",))[0] != a[0]
    assert chunk_keys("fp", list(range(512)), 256) == a[:2]
