"""ops.causal_attention against a plain float64 reference, written out head by head.

The engine's version computes queries in blocks, masks only the keys a block can hide, and
divides after the value product; the reference does none of that. Blocks are forced small
here so that block edges fall inside the prompts.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from worker.engine import kernels, ops
from worker.engine.kernels import attention
from worker.engine.kernels.simd import load_f32x8, store_f32x8
from worker.engine.kernels.wide_simd import WIDTH, load_floats, put_bf16
from worker.engine.kv_cache import key_runs, keys_of_runs


def reference(q, keys, values, first_pos, scale, window=None, softcap=None):
    n_tokens, n_head, _ = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    out = np.zeros((n_tokens, n_head, values.shape[-1]))
    for t in range(n_tokens):
        pos = first_pos + t
        for h in range(n_head):
            k, v = keys[h // group].astype(np.float64), values[h // group].astype(np.float64)
            scores = k @ q[t, h].astype(np.float64) * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            visible = np.arange(len(k)) <= pos
            if window is not None:
                visible &= pos - np.arange(len(k)) < window
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max())
            out[t, h] = weights @ v / weights.sum()
    return out.reshape(n_tokens, -1)


@pytest.mark.parametrize("n_tokens, first_pos, window, softcap", [
    (1, 0, None, None),       # the first token of a prompt
    (1, 40, None, None),      # a decode step
    (7, 0, None, None),       # a whole prompt
    (9, 33, None, None),      # a chunk after a cached prefix
    (9, 33, 5, None),         # a sliding window
    (1, 40, 6, None),         # a decode step under a window
    (6, 10, None, 20.0),      # soft-capped scores
])
def test_blocked_attention_matches_the_reference(monkeypatch, n_tokens, first_pos, window, softcap):
    rng = np.random.default_rng(n_tokens * 100 + first_pos)
    n_kv, group, head_dim, value_dim = 2, 3, 8, 6
    n_keys = first_pos + n_tokens
    capacity = n_keys + 5  # a cache is a prefix of a larger buffer, as in KVCache
    keys = rng.standard_normal((n_kv, capacity, head_dim), dtype=np.float32)[:, :n_keys]
    values = rng.standard_normal((n_kv, capacity, value_dim), dtype=np.float32)[:, :n_keys]
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)
    # two queries per block: block edges fall inside the chunk
    monkeypatch.setattr(ops, "SCORES_BUDGET", 4 * n_kv * group * n_keys * 2)
    got = ops.causal_attention(q, keys, values, first_pos, 0.35, window, softcap)
    want = reference(q, keys, values, first_pos, 0.35, window, softcap)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels need AVX2, FMA and F16C")


@needs_kernels
@pytest.mark.parametrize("n_tokens, first_pos, window, softcap, head_dim, value_dim", [
    (1, 0, None, None, 64, 64),        # the first token
    (1, 150, None, None, 64, 64),      # a decode step over three key blocks
    (37, 0, None, None, 64, 64),       # a prompt: query blocks of 8, a partial last one
    (37, 150, None, None, 16, 80),     # a chunk after a prefix; values 64 + 16 wide
    (21, 100, 50, None, 32, 32),       # a sliding window that starts inside a key block
    (5, 70, None, 30.0, 64, 16),       # soft-capped scores
])
def test_compiled_attention_matches_the_reference(n_tokens, first_pos, window, softcap, head_dim, value_dim):
    rng = np.random.default_rng(n_tokens * 1000 + first_pos)
    n_kv, group = 2, 3
    n_keys = first_pos + n_tokens
    keys = rng.standard_normal((n_kv, n_keys + 5, head_dim), dtype=np.float32)[:, :n_keys]
    values = rng.standard_normal((n_kv, n_keys + 5, value_dim), dtype=np.float32)[:, :n_keys]
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)
    out = np.empty((n_tokens, n_kv * group * value_dim), dtype=np.float32)
    got = attention.causal_attention(q, key_runs(keys), values, first_pos, np.float32(0.2), window or 0,
                                     np.float32(softcap or 0.0), out, False,
                                     attention.task_addresses(values.dtype))
    want = reference(q, keys, values, first_pos, 0.2, window, softcap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ops.causal_attention(q, keys, values, first_pos, 0.2, window, softcap), got)


def bfloat16(a: np.ndarray) -> np.ndarray:
    """Each value rounded to the nearest bfloat16 (ties to the even one), as float32: chosen by
    distance from the two bfloat16 neighbours, not by the kernels' bit arithmetic."""
    a = np.asarray(a, dtype=np.float32)
    down = (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # toward zero
    up = (down.view(np.uint32) + np.uint32(0x10000)).view(np.float32)  # the next one away from zero
    gap_down = np.abs(a.astype(np.float64) - down)
    gap_up = np.abs(up.astype(np.float64) - a)
    even_down = (down.view(np.uint32) >> 16) % 2 == 0
    return np.where((gap_down < gap_up) | ((gap_down == gap_up) & even_down), down, up)


@njit
def _rounded_by_the_kernels(x):
    out = np.empty(x.shape[0], dtype=np.uint16)
    for i in range(0, x.shape[0], 16):
        put_bf16(out, i, load_floats(x, i))
    return out


@pytest.mark.skipif(WIDTH != 16, reason="bfloat16 lanes are 512-bit vectors' (the tile unit's path)")
def test_bfloat16_rounding_is_to_nearest_ties_to_even():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    ties = (x.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly between two
    few = np.float32([0.0, -0.0, 1.0, -3.5, 65504.0, 1.00390625, 1.01171875, 3.0e38] + [0.5] * 8)
    x = np.concatenate([x, ties.view(np.float32), few])  # whole vectors of 16
    got = (_rounded_by_the_kernels(x).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, bfloat16(x))


needs_tile_attention = pytest.mark.skipif(not attention.TILED, reason="the tile path needs AMX-BF16 (and AMX-INT8)")


@needs_tile_attention
@pytest.mark.parametrize("n_tokens, first_pos, window, softcap, head_dim, value_dim, group", [
    (1, 0, None, None, 64, 64, 3),       # the first token, one tile of rows mostly padding
    (1, 150, None, None, 128, 128, 2),   # one row per head over two key blocks (three of the loops')
    (37, 0, None, None, 64, 64, 3),      # a prompt: 111 rows, a partial last tile
    (37, 150, None, None, 256, 32, 4),   # a chunk after a prefix; gemma's 256-dim heads
    (21, 100, 50, None, 32, 16, 1),      # a sliding window that starts inside a key block
    (40, 300, 100, None, 64, 64, 2),     # ... inside the second, the rows reaching into the third
    (5, 70, None, 30.0, 64, 48, 3),      # soft-capped scores, values three tiles wide
])
def test_tile_attention_matches_the_reference_on_bfloat16_inputs(n_tokens, first_pos, window, softcap, head_dim,
                                                               value_dim, group):
    """The tile unit's path rounds queries, keys, values and the softmax's weights to bfloat16
    and sums in float32: it agrees with the float64 reference of the rounded inputs to what
    rounding the weights moves (each by at most 2^-9 of itself, and their sum with them: an
    output by at most 2^-8 of the largest value), and with the float32 path to a bfloat16's step."""
    rng = np.random.default_rng(n_tokens * 1000 + first_pos)
    n_kv = 2
    n_keys = first_pos + n_tokens
    keys = rng.standard_normal((n_kv, n_keys + 5, head_dim), dtype=np.float32)[:, :n_keys]
    values = rng.standard_normal((n_kv, n_keys + 5, value_dim), dtype=np.float32)[:, :n_keys]
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)

    def attend(tiled):
        out = np.empty((n_tokens, n_kv * group * value_dim), dtype=np.float32)
        return attention.causal_attention(q, key_runs(keys), values, first_pos, np.float32(0.2), window or 0,
                                          np.float32(softcap or 0.0), out, tiled,
                                          attention.task_addresses(values.dtype))
    got = attend(True)
    rounded = reference(bfloat16(q), bfloat16(keys), bfloat16(values), first_pos, 0.2, window, softcap)
    np.testing.assert_allclose(got, rounded, rtol=0, atol=np.abs(values).max() / 256)
    exact = reference(q, keys, values, first_pos, 0.2, window, softcap)
    assert 1e-5 < np.abs(got - exact).max() < 3e-2  # bfloat16's, not float32's, rounding
    np.testing.assert_allclose(attend(False), exact, rtol=2e-5, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("group, window, half, head_dim", [
    (3, 0, False, 64),   # rows in fours cross token edges
    (2, 0, True, 64),    # an f16 cache
    (1, 40, True, 64),   # one head per KV head, a sliding window inside key blocks
    (5, 0, False, 64),   # a group whose rows leave a remainder after the fours
    (2, 0, True, 128),   # Qwen3's heads
    (3, 0, False, 40),   # a head of 40 dims
])
@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=needs_tile_attention)])
def test_a_query_gets_the_same_bits_in_any_chunk(group, window, half, head_dim, tiled):
    """What a query computes depends on its position and the cache only: a prompt attended in
    one call (rows four at a time, scores from the key block widened into scratch), in uneven
    chunks, or a token at a time (rows two at a time from the runs in place) gives identical rows."""
    rng = np.random.default_rng(9)
    n_tokens, n_kv = 150, 3
    keys = rng.standard_normal((n_kv, n_tokens, head_dim), dtype=np.float32)
    values = rng.standard_normal((n_kv, n_tokens, head_dim), dtype=np.float32)
    if half:
        keys, values = (a.astype(np.float16).view(np.uint16) for a in (keys, values))
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)
    runs = key_runs(keys)

    def attend(a, b):
        out = np.empty((b - a, n_kv * group * head_dim), dtype=np.float32)
        return attention.causal_attention(q[a:b], runs, values[:, :b], a, np.float32(0.125), window,
                                          np.float32(0.0), out, tiled, attention.task_addresses(values.dtype))
    whole = attend(0, n_tokens)
    for cuts in ([0, 7, 8, 70, 150], list(range(151))):
        parts = [attend(a, b) for a, b in zip(cuts, cuts[1:])]
        np.testing.assert_array_equal(np.concatenate(parts), whole)


@needs_tile_attention
def test_a_prompts_rows_get_the_same_bits_in_tasks_of_either_size():
    """The tile unit's tasks take TILE_QUERY_BLOCK positions where that still makes TILE_TASKS
    tasks, QUERY_BLOCK otherwise: a row's bits are the same either way."""
    rng = np.random.default_rng(11)
    n_tokens, n_kv, group, head_dim = 300, 4, 2, 64
    keys = rng.standard_normal((n_kv, n_tokens, head_dim)).astype(np.float16).view(np.uint16)
    values = rng.standard_normal((n_kv, n_tokens, head_dim)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)
    runs = key_runs(keys)

    def attend(a, b):
        out = np.empty((b - a, n_kv * group * head_dim), dtype=np.float32)
        return attention.causal_attention(q[a:b], runs, values[:, :b], a, np.float32(0.125), 0, np.float32(0.0),
                                          out, True, attention.task_addresses(values.dtype))
    assert attention.task_positions(q, n_kv, values, True) == attention.TILE_QUERY_BLOCK  # 2 blocks x 4 heads
    assert attention.task_positions(q[:150], n_kv, values, True) == attention.QUERY_BLOCK  # 1 x 4
    whole = attend(0, n_tokens)
    for cuts in ([0, 150, 300], [0, 7, 8, 70, 300]):
        np.testing.assert_array_equal(np.concatenate([attend(a, b) for a, b in zip(cuts, cuts[1:])]), whole)


@pytest.mark.parametrize("n_keys, d", [(1, 8), (63, 16), (64, 40), (200, 128)])
def test_key_runs_hold_positions_dim_by_dim_in_whole_key_blocks(n_keys, d):
    """``key_runs`` puts key p's dim i at run p // RUN, row i, lane p % RUN, pads with zero keys
    to whole key blocks (attention reads whole blocks), and ``keys_of_runs`` gives any span back."""
    rng = np.random.default_rng(n_keys)
    keys = rng.standard_normal((3, n_keys, d)).astype(np.float16)
    runs = key_runs(keys)
    assert runs.shape == (3, -(-n_keys // attention.KEYS_WHOLE) * attention.KEYS_WHOLE // attention.RUN, d,
                          attention.RUN)
    p = n_keys - 1
    np.testing.assert_array_equal(runs[:, p // attention.RUN, :, p % attention.RUN], keys[:, p])
    assert not keys_of_runs(runs, n_keys, runs.shape[1] * attention.RUN).any()
    np.testing.assert_array_equal(keys_of_runs(runs, 0, n_keys), keys)
    np.testing.assert_array_equal(keys_of_runs(runs, n_keys // 3, n_keys), keys[:, n_keys // 3:])


@needs_kernels
def test_exp_nonpositive_is_close_to_numpy():
    x = -np.concatenate([np.linspace(0, 90, 100_001), [1e-9, 0.5, 86.9]]).astype(np.float32)
    got = np.array([attention.exp_nonpositive(np.float32(v)) for v in x[::97]], dtype=np.float64)
    want = np.exp(x[::97].astype(np.float64))
    normal = want > 1e-37
    relative = np.abs(got[normal] - want[normal]) / want[normal]
    assert relative.max() < 1e-5  # float32's own rounding of x·log2(e) is ~5e-6 near x = -87
    assert relative[x[::97][normal] > -10].max() < 1e-6
    assert np.all(got[~normal] < 1e-37)


@needs_kernels
def test_exp_nonpositive8_is_close_to_numpy():
    x = -np.concatenate([np.linspace(0, 90, 8 * 12_500), [1e-9, 0.5, 86.9, 87.0, 200.0, np.inf, 0.0, 3.0]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    exp_lanes(x, got)
    want = np.exp(x.astype(np.float64))
    normal = want > 1e-37
    relative = np.abs(got[normal] - want[normal]) / want[normal]
    assert relative.max() < 1e-5
    assert relative[x[normal] > -10].max() < 1e-6
    assert np.all(got[~normal] < 1e-37) and np.all(got >= 0)


@njit
def exp_lanes(x, out):
    for i in range(0, x.shape[0], 8):
        store_f32x8(out, i, attention.exp_nonpositive8(load_f32x8(x, i)))
