"""Causal grouped-query attention over a KV cache, compiled, with an online softmax.

A task is one KV head and a block of up to QUERY_BLOCK query positions, with the G query heads
that read that KV head: each key and value row is loaded once for all of them. Keys go in
blocks of KEY_BLOCK at fixed positions (0, 64, 128, ...); the running maximum, sum and output
of each query row are rescaled when a block raises the maximum, so no [T, L] score matrix is
built and memory stays flat as the context grows. Sliding windows limit the keys a query sees;
a logit softcap bends scores through tanh.

Each query's arithmetic depends only on its own position and the cache, never on which other
queries share its call or its task: a prompt computed in one chunk or several, alone or in a
batch, gets the same bits (the int8 rounding of the next projection would magnify any
difference into a visible one).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from worker.engine.kernels.simd import (add_f32, fmadd, load_f32x8, load_kv8, splat_f32, store_f32x8, store_kv8,
                                        sum_pairs_f32, sums8_f32, zeros_f32)

KEY_BLOCK = 64
QUERY_BLOCK = 8


@intrinsic
def _float_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always", fastmath=True, cache=True)
def exp_nonpositive(x):
    """e^x for x <= 0 (relative error below 1e-6 for x > -10, 5e-6 near -87, where float32's
    rounding of x·log2(e) dominates; about 0 below -87), in operations a loop vectorizes:
    x = n ln2 + f ln2 with |f| <= 1/2, 2^f by its Taylor polynomial, 2^n put in the exponent."""
    t = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.floor(t + np.float32(0.5))
    f = t - n
    p = np.float32(1.5252734e-5)
    p = p * f + np.float32(1.5403530e-4)
    p = p * f + np.float32(1.3333558e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022651e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    # int32 throughout: AVX2 converts 8 floats to int32 at once, but not to int64
    return p * _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", cache=True)
def _block_sum(row):
    """The sum of a block's KEY_BLOCK scores in one fixed order (eight lanes, then a fixed tree):
    never the order a compiler would pick for the row's alignment in memory."""
    a = add_f32(load_f32x8(row, 0), load_f32x8(row, 8))
    b = add_f32(load_f32x8(row, 16), load_f32x8(row, 24))
    c = add_f32(load_f32x8(row, 32), load_f32x8(row, 40))
    d = add_f32(load_f32x8(row, 48), load_f32x8(row, 56))
    return sum_pairs_f32(add_f32(add_f32(a, b), add_f32(c, d)))


@njit(inline="always", cache=True)
def _dot(query, key, head_dim):
    acc = zeros_f32()
    for i in range(0, head_dim, 8):
        acc = fmadd(load_f32x8(query, i), load_kv8(key, i), acc)
    return sum_pairs_f32(acc)


@njit(inline="always", cache=True)
def _scores(q, t, h, keys, kv, lo, hi, start, scale, softcap, scores, row):
    """scores[row, j - start] for keys lo..hi-1 of one query row; returns their maximum.

    Eight keys at a time share each load of the query (eight independent sums); every key's
    sum runs over the head in the same order whatever keys it is grouped with."""
    head_dim = q.shape[2]
    query = q[t, h]
    j = lo
    while j + 8 <= hi:
        k0, k1, k2, k3 = keys[kv, j], keys[kv, j + 1], keys[kv, j + 2], keys[kv, j + 3]
        k4, k5, k6, k7 = keys[kv, j + 4], keys[kv, j + 5], keys[kv, j + 6], keys[kv, j + 7]
        a0, a1, a2, a3 = zeros_f32(), zeros_f32(), zeros_f32(), zeros_f32()
        a4, a5, a6, a7 = zeros_f32(), zeros_f32(), zeros_f32(), zeros_f32()
        for i in range(0, head_dim, 8):
            x = load_f32x8(query, i)
            a0 = fmadd(x, load_kv8(k0, i), a0)
            a1 = fmadd(x, load_kv8(k1, i), a1)
            a2 = fmadd(x, load_kv8(k2, i), a2)
            a3 = fmadd(x, load_kv8(k3, i), a3)
            a4 = fmadd(x, load_kv8(k4, i), a4)
            a5 = fmadd(x, load_kv8(k5, i), a5)
            a6 = fmadd(x, load_kv8(k6, i), a6)
            a7 = fmadd(x, load_kv8(k7, i), a7)
        store_f32x8(scores[row], j - start, sums8_f32(a0, a1, a2, a3, a4, a5, a6, a7))
        j += 8
    while j < hi:
        scores[row, j - start] = _dot(query, keys[kv, j], head_dim)
        j += 1
    block_max = np.float32(-np.inf)
    if softcap > 0:
        for j in range(lo - start, hi - start):
            s = softcap * np.tanh(scores[row, j] * scale / softcap)
            scores[row, j] = s
            block_max = max(block_max, s)
    else:  # its own loop: without the call to tanh it vectorizes
        for j in range(lo - start, hi - start):
            s = scores[row, j] * scale
            scores[row, j] = s
            block_max = max(block_max, s)
    return block_max


@njit(inline="always", cache=True)
def _add_values(values, kv, lo, hi, start, scores, row, acc):
    """acc[row] += Σ_j p_j · values[kv, j] over keys lo..hi-1: 64 values at a time (eight
    independent sums), then 16; each value's sum runs over the keys in order."""
    value_dim = values.shape[2]
    out = acc[row]
    i = 0
    while i + 64 <= value_dim:
        a0, a1, a2, a3 = load_f32x8(out, i), load_f32x8(out, i + 8), load_f32x8(out, i + 16), load_f32x8(out, i + 24)
        a4, a5, a6, a7 = (load_f32x8(out, i + 32), load_f32x8(out, i + 40), load_f32x8(out, i + 48),
                          load_f32x8(out, i + 56))
        for j in range(lo, hi):
            p = splat_f32(scores[row, j - start])
            v = values[kv, j]
            a0 = fmadd(p, load_kv8(v, i), a0)
            a1 = fmadd(p, load_kv8(v, i + 8), a1)
            a2 = fmadd(p, load_kv8(v, i + 16), a2)
            a3 = fmadd(p, load_kv8(v, i + 24), a3)
            a4 = fmadd(p, load_kv8(v, i + 32), a4)
            a5 = fmadd(p, load_kv8(v, i + 40), a5)
            a6 = fmadd(p, load_kv8(v, i + 48), a6)
            a7 = fmadd(p, load_kv8(v, i + 56), a7)
        store_f32x8(out, i, a0)
        store_f32x8(out, i + 8, a1)
        store_f32x8(out, i + 16, a2)
        store_f32x8(out, i + 24, a3)
        store_f32x8(out, i + 32, a4)
        store_f32x8(out, i + 40, a5)
        store_f32x8(out, i + 48, a6)
        store_f32x8(out, i + 56, a7)
        i += 64
    while i < value_dim:
        a0, a1 = load_f32x8(out, i), load_f32x8(out, i + 8)
        for j in range(lo, hi):
            p = splat_f32(scores[row, j - start])
            v = values[kv, j]
            a0 = fmadd(p, load_kv8(v, i), a0)
            a1 = fmadd(p, load_kv8(v, i + 8), a1)
        store_f32x8(out, i, a0)
        store_f32x8(out, i + 8, a1)
        i += 16


@njit(parallel=True, fastmath=True, cache=True)
def causal_attention(q, keys, values, first_pos, scale, window, softcap, out):
    """q [T, H, d]; keys [K, L, d]; values [K, L, dv] with L = first_pos + T; out [T, H*dv].
    d must be a multiple of 8, dv of 16; the last axis of each array contiguous. Keys and
    values are float32, or uint16 holding IEEE halves (an f16 cache).

    Query t (at position first_pos + t) sees key j iff j <= first_pos + t and, when window > 0,
    first_pos + t - j < window. softcap > 0 replaces a score s by softcap * tanh(s / softcap).
    """
    n_tokens, n_head, head_dim = q.shape
    n_kv = keys.shape[0]
    value_dim = values.shape[2]
    group = n_head // n_kv
    query_blocks = (n_tokens + QUERY_BLOCK - 1) // QUERY_BLOCK
    for task in prange(n_kv * query_blocks):
        kv = task % n_kv
        # blocks in the order first, last, second, second last, ...: later queries see more
        # keys, and each thread takes a contiguous run of tasks
        order = task // n_kv
        block = order // 2 if order % 2 == 0 else query_blocks - 1 - order // 2
        t0 = block * QUERY_BLOCK
        t1 = min(n_tokens, t0 + QUERY_BLOCK)
        rows = (t1 - t0) * group
        scores = np.empty((rows, KEY_BLOCK), dtype=np.float32)
        acc = np.zeros((rows, value_dim), dtype=np.float32)
        running_max = np.full(rows, -np.inf, dtype=np.float32)
        running_sum = np.zeros(rows, dtype=np.float32)
        lowest = max(0, first_pos + t0 - window + 1) if window > 0 else 0
        last = first_pos + t1 - 1
        for start in range(lowest - lowest % KEY_BLOCK, last + 1, KEY_BLOCK):
            for t in range(t0, t1):
                pos = first_pos + t
                lo = max(start, pos - window + 1) if window > 0 else start
                hi = min(start + KEY_BLOCK, pos + 1)
                if lo >= hi:
                    continue
                for g in range(group):
                    row = (t - t0) * group + g
                    block_max = _scores(q, t, kv * group + g, keys, kv, lo, hi, start, scale, softcap, scores, row)
                    new_max = max(running_max[row], block_max)
                    correction = exp_nonpositive(running_max[row] - new_max)
                    running_max[row] = new_max
                    for j in range(lo - start, hi - start):
                        scores[row, j] = exp_nonpositive(scores[row, j] - new_max)
                    for j in range(lo - start):  # keys of the block this query does not see
                        scores[row, j] = 0.0
                    for j in range(hi - start, KEY_BLOCK):
                        scores[row, j] = 0.0
                    running_sum[row] = running_sum[row] * correction + _block_sum(scores[row])
                    for i in range(value_dim):
                        acc[row, i] *= correction
                    _add_values(values, kv, lo, hi, start, scores, row, acc)
        for t in range(t0, t1):
            for g in range(group):
                row = (t - t0) * group + g
                h = kv * group + g
                inverse = np.float32(1.0) / running_sum[row]
                for i in range(value_dim):
                    out[t, h * value_dim + i] = acc[row, i] * inverse
    return out


@njit(cache=True)
def store_and_attend(q, k, v, keys, values, first_pos, scale, window, softcap, out):
    """Write this step's k [T, K, d] and v [T, K, dv] at positions first_pos.. of a cache's
    keys [K, capacity, d] and values [K, capacity, dv] (float32 or f16 bits), then attend
    (``causal_attention``) over everything up to them."""
    n_tokens, n_kv, head_dim = k.shape
    value_dim = v.shape[2]
    for t in range(n_tokens):
        for h in range(n_kv):
            key, value = keys[h, first_pos + t], values[h, first_pos + t]
            for i in range(0, head_dim, 8):
                store_kv8(key, i, load_f32x8(k[t, h], i))
            for i in range(0, value_dim, 8):
                store_kv8(value, i, load_f32x8(v[t, h], i))
    end = first_pos + n_tokens
    return causal_attention(q, keys[:, :end], values[:, :end], first_pos, scale, window, softcap, out)
