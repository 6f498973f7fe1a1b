"""The KV cache's two storage types: f16 holds half the bytes of f32, rounds each key and value
to the nearest half, and an engine's fingerprint (the key of spilled KV) tells them apart."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ModelLoadError
from worker.engine import kernels
from worker.engine import Engine
from worker.engine.kv_cache import KVCache


def _filled(kv_type: str, tokens: int = 40) -> tuple[KVCache, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((tokens, 2, 16)) * 3).astype(np.float32)
    v = (rng.standard_normal((tokens, 2, 16)) * 3).astype(np.float32)
    cache = KVCache(n_layer=3, n_kv_head=2, head_dim=16, max_tokens=512, kv_type=kv_type)
    cache.reserve(tokens)
    for layer in range(3):
        cache.write(layer, k, v)
    cache.commit(list(range(tokens)))
    return cache, k, v


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_storage_type_sets_bytes_and_rounding(kv_type):
    cache, k, v = _filled(kv_type)
    itemsize = 2 if kv_type == "f16" else 4
    assert cache.bytes_per_token == 3 * 2 * (16 + 16) * itemsize
    assert cache.nbytes == 256 * cache.bytes_per_token  # one growth block
    keys, values = cache.export(0, 40)
    assert keys.dtype == values.dtype == np.dtype(np.float16 if kv_type == "f16" else np.float32)
    # what is held is the input rounded to the storage type: exactly numpy's conversion
    np.testing.assert_array_equal(keys[1], k.transpose(1, 0, 2).astype(keys.dtype))
    np.testing.assert_array_equal(values[2], v.transpose(1, 0, 2).astype(values.dtype))


def test_compiled_store_rounds_like_numpy():
    """The compiled step that writes this step's keys while attending writes the same halves
    as numpy's assignment does."""
    if not kernels.available():
        pytest.skip("the compiled kernels need AVX2, FMA and F16C")
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((5, 2, 16)) * 50).astype(np.float32)
    v = (rng.standard_normal((5, 2, 16)) * 50).astype(np.float32)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    compiled = KVCache(1, 2, 16, 64, kv_type="f16")
    compiled.reserve(5)
    out = np.empty((5, 4 * 16), dtype=np.float32)
    compiled.store_and_attend(0, q, k, v, 0.25, None, out)
    compiled.commit(list(range(5)))
    np.testing.assert_array_equal(compiled.export(0, 5)[0][0], k.transpose(1, 0, 2).astype(np.float16))
    np.testing.assert_array_equal(compiled.export(0, 5)[1][0], v.transpose(1, 0, 2).astype(np.float16))
    assert np.isfinite(out).all()


def test_fingerprint_depends_on_the_kv_type(default_model):
    f16 = Engine.load(default_model)
    f32 = Engine.load(default_model, kv_type="f32")
    assert f16.model.kv_type == "f16" and f32.model.kv_type == "f32"
    assert f16.fingerprint != f32.fingerprint  # spilled chunks of one never restore into the other
    assert f16.new_cache(1).bytes_per_token * 2 == f32.new_cache(1).bytes_per_token


def test_unknown_kv_type_is_refused(default_model):
    with pytest.raises(ModelLoadError, match="KV cache type"):
        Engine.load(default_model, kv_type="q8_0")
