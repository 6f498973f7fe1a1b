"""The KV cache's two storage types: f16 holds half the bytes of f32, rounds each key and value
to the nearest half, and an engine's fingerprint (the key of spilled KV) tells them apart."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from shared.errors import ModelLoadError
from worker.engine import kernels
from worker.engine import Engine
from worker.engine.kernels.attention import RUN
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
    compiled.store_and_attend(0, q, k, v, 0.25, 0, out)
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


GROWTH_SCRIPT = r"""
import numpy as np
from worker.engine.kernels.attention import RUN
from worker.engine.kv_cache import KVCache

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key)) / 1024

cache = KVCache(30, 3, 64, 20000)
cache.reserve(6000)
rng = np.random.default_rng(0)
for layer in range(30):
    cache.put_key_rows(layer, 0, rng.standard_normal((3, 6000, 64)).astype(np.float16))
    cache.values[layer][:, :6000] = cache.key_rows(layer, 0, 6000) * 2
cache.commit(list(range(6000)))
first = [cache.key_rows(layer, 0, 6000) for layer in (0, 29)]
peak = status("VmHWM:")
cache.reserve(6000)
assert all(np.array_equal(cache.key_rows(l, 0, 6000), f) for l, f in zip((0, 29), first))
assert np.array_equal(cache.values[29][:, :6000], first[1] * 2)
print(status("VmHWM:") - peak)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_growing_cache_holds_its_old_block_and_one_new_layer_not_both_blocks():
    done = subprocess.run([sys.executable, "-c", GROWTH_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    grew = float(done.stdout)
    # 135 MiB of keys and values are held before and after; a layer of them is 4.5 MiB. Holding
    # the old block and the new one together would raise the peak by about 135 MiB.
    assert grew < 16, f"the peak rose by {grew:.0f} MiB while the cache grew"


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_layers_of_their_own_shapes_grow_export_and_restore(kv_type):
    """A cache whose layers differ (gemma4: sliding layers of 2 heads × 16, global ones of
    1 head × 32) keeps each layer's positions through growth, and its chunks go out and back."""
    shapes = [(2, 16, 16), (1, 32, 32), (2, 16, 16)]
    cache = KVCache(3, 2, 32, 1024, kv_type=kv_type, layers=shapes)
    itemsize = 2 if kv_type == "f16" else 4
    assert cache.bytes_per_token == (2 * 32 + 64 + 2 * 32) * itemsize
    rng = np.random.default_rng(3)
    written = {}
    for step in (200, 100):  # the second step grows the cache past its first block
        cache.reserve(step)
        for layer, (heads, d, dv) in enumerate(shapes):
            k = rng.standard_normal((step, heads, d)).astype(np.float32)
            v = rng.standard_normal((step, heads, dv)).astype(np.float32)
            cache.write(layer, k, v)
            written.setdefault(layer, []).append((k, v))
        cache.commit(list(range(cache.length, cache.length + step)))
    assert cache.capacity == 512 and cache.length == 300
    for layer in range(3):
        k = np.concatenate([k for k, _ in written[layer]]).transpose(1, 0, 2).astype(cache.dtype)
        np.testing.assert_array_equal(cache.key_rows(layer, 0, 300), k)
    keys, values = cache.export(100, 50)
    assert (keys.shape, values.shape) == cache.chunk_shapes(50) == (((2 * 16 + 32 + 2 * 16) * 50,),) * 2
    other = KVCache(3, 2, 32, 1024, kv_type=kv_type, layers=shapes)
    other.reserve(100)
    for layer in range(3):
        other.write(layer, *(a[:100] for a in written[layer][0]))
    other.commit(list(range(100)))
    other.restore(100, keys, values, list(range(100, 150)))
    for layer in range(3):
        np.testing.assert_array_equal(other.key_rows(layer, 0, 150), cache.key_rows(layer, 0, 150))
        np.testing.assert_array_equal(other.values[layer][:, :150], cache.values[layer][:, :150])
    with pytest.raises(ValueError):
        other.restore(150, keys[:-1], values, list(range(150, 200)))


# --- sliding layers give back what they will not read again ---------------------------------

@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    from tiny_models import write_tiny_gguf

    from worker.engine.archs import load_model
    from worker.engine.gguf_file import GGUFFile

    path = tmp_path_factory.mktemp("sliding") / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3")  # five layers sliding over 4 positions, then a global one
    return load_model(GGUFFile(path))


def _windowless(model, capacity: int) -> KVCache:
    hp = model.hp
    return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, capacity, hp.value_dim, model.kv_type)


def test_sliding_layers_give_back_old_positions_and_read_the_same(sliding_model):
    from worker.engine.kv_cache import READ_MARGIN, RELEASE_STEP

    model = sliding_model
    tokens = list(np.random.default_rng(1).integers(3, 200, 700))
    cache, reference = model.new_cache(800), _windowless(model, 800)
    assert cache.windows == [4, 4, 4, 4, 4, 0] and reference.windows == [0] * 6
    for start in range(0, 700, 100):  # prefill in chunks, then decode: the same bits either way
        got = model.forward([(cache, tokens[start:start + 100])])[0]
        np.testing.assert_array_equal(got, model.forward([(reference, tokens[start:start + 100])])[0])
    for token in (5, 6, 7):
        np.testing.assert_array_equal(model.forward([(cache, [token])])[0], model.forward([(reference, [token])])[0])
    assert cache.released >= 703 - 4 - READ_MARGIN - RELEASE_STEP and cache.released > 0
    # the pages went back (whole pages of whole runs of keys: a page's worth of positions and a
    # run may stay): they read as zeros in the sliding layers, and the global layer keeps them
    gone = cache.released - RUN - mmap.PAGESIZE // (model.hp.head_dim * cache.dtype.itemsize)
    assert gone > 0 and not cache.key_rows(0, 0, gone).any() and not cache.values[4][:, :gone].any()
    assert cache.key_rows(5, 0, cache.released).all(axis=-1).any()
    # what it holds at most: the window (and the steps before it goes) of every sliding layer
    per_layer = reference.full_bytes(1) // 6
    assert cache.full_bytes(703) == per_layer * (5 * (4 + READ_MARGIN + RELEASE_STEP) + 703)
    assert reference.full_bytes(703) == per_layer * 6 * 703


def test_a_cache_continues_only_where_it_holds_the_windows(sliding_model):
    model = sliding_model
    tokens = list(np.random.default_rng(2).integers(3, 200, 600))
    cache = model.new_cache(700)
    model.forward([(cache, tokens)])
    floor = cache.released + cache.reach
    assert cache.common_prefix(tokens) == 600 and cache.continues_from(floor)
    assert cache.common_prefix(tokens[:floor - 1] + [1]) == 0  # its windows are gone: start afresh
    with pytest.raises(ValueError, match="sliding layers hold them from"):
        cache.export(0, 64)
    cache.truncate(floor - 1)
    assert cache.length == 0 and cache.released == 0


def test_positions_wait_for_the_kvstore_before_they_go(sliding_model):
    model = sliding_model
    cache = model.new_cache(700)
    cache.spilled = 0  # a kvstore takes chunks as they fill: nothing goes before it has them
    model.forward([(cache, list(range(3, 603)))])
    assert cache.released == 0
    cache.spilled = 512
    model.forward([(cache, [7])])
    assert cache.released == 512


@pytest.mark.parametrize("resumable", [True, False])
def test_a_cache_keeps_the_windows_before_its_prompts_end_for_the_next_turn(sliding_model, resumable):
    from worker.engine.kv_cache import RELEASE_STEP

    model = sliding_model
    rng = np.random.default_rng(4)
    prompt, reply = list(rng.integers(3, 200, 400)), list(rng.integers(3, 200, 500))
    cache = model.new_cache(1000)
    if resumable:
        cache.resumable_at = len(prompt) - 1  # as the scheduler marks a request's prompt
    model.forward([(cache, prompt)])
    for start in range(0, len(reply), 100):  # the reply, read back as it is written
        model.forward([(cache, reply[start:start + 100])])
    # the same prompt again, or the next turn after a reply rendered otherwise: it goes on from
    # the prompt's last token where the mark was set, and starts afresh where not
    assert cache.continues_from(len(prompt) - 1) == resumable
    assert cache.common_prefix(prompt) == (len(prompt) if resumable else 0)
    # the mark holds back only what lies behind it: the sliding layers still let go of the rest
    assert 0 < cache.released <= len(prompt) - 1 - cache.reach if resumable else cache.released > len(prompt)
    assert cache.released >= len(prompt) - 1 - cache.reach - RELEASE_STEP
    # and the positions it kept read the same as a cache that never released any
    reference = _windowless(model, 1000)
    model.forward([(reference, prompt[:-1])])
    if resumable:
        cache.truncate(len(prompt) - 1)
        np.testing.assert_array_equal(model.forward([(cache, prompt[-1:] + [9])])[0],
                                      model.forward([(reference, prompt[-1:] + [9])])[0])
