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

from worker.engine.kernels.simd import (add_f32, floor_f32, fmadd, keep_lanes_f32, load_f32x8, load_kv8, max_f32,
                                        max_lane_f32, mul_f32, pow2_f32, splat_f32, store_f32x8, store_kv8, sub_f32,
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
def exp_nonpositive8(x):
    """``exp_nonpositive`` on eight lanes."""
    t = mul_f32(max_f32(x, splat_f32(-87.0)), splat_f32(1.4426950408889634))
    n = floor_f32(add_f32(t, splat_f32(0.5)))
    f = sub_f32(t, n)
    p = fmadd(splat_f32(1.5252734e-5), f, splat_f32(1.5403530e-4))
    p = fmadd(p, f, splat_f32(1.3333558e-3))
    p = fmadd(p, f, splat_f32(9.6181291e-3))
    p = fmadd(p, f, splat_f32(5.5504109e-2))
    p = fmadd(p, f, splat_f32(2.4022651e-1))
    p = fmadd(p, f, splat_f32(6.9314718e-1))
    p = fmadd(p, f, splat_f32(1.0))
    return mul_f32(p, pow2_f32(n))


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
def _span(start, pos, window):
    """The keys of the block from ``start`` that the query at ``pos`` sees: lo..hi-1."""
    lo = max(start, pos - window + 1) if window > 0 else start
    return lo, min(start + KEY_BLOCK, pos + 1)


@njit(inline="always", cache=True)
def _raw_scores(query, keys, kv, lo, hi, start, scores, row):
    """scores[row, j - start] = query · keys[kv, j] for keys lo..hi-1.

    Eight keys at a time share each load of the query (eight independent sums); every key's
    sum runs over the head in lanes of eight, then across the lanes in one fixed order, whatever
    keys or rows it is grouped with."""
    head_dim = query.shape[0]
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


@njit(inline="always", cache=True)
def _raw_scores_tile(q0, q1, q2, q3, keys, kv, lo, hi, start, scores, row, lanes):
    """``_raw_scores`` for four query rows (row..row+3) at once, two keys at a time: each key's
    load (and f16 widening) serves four rows, each row's load two keys; the eight sums are the
    same chains ``_raw_scores`` runs."""
    head_dim = q0.shape[0]
    j = lo
    while j + 2 <= hi:
        k0, k1 = keys[kv, j], keys[kv, j + 1]
        a0, a1, a2, a3 = zeros_f32(), zeros_f32(), zeros_f32(), zeros_f32()
        a4, a5, a6, a7 = zeros_f32(), zeros_f32(), zeros_f32(), zeros_f32()
        for i in range(0, head_dim, 8):
            x0, x1 = load_kv8(k0, i), load_kv8(k1, i)
            y = load_f32x8(q0, i)
            a0 = fmadd(y, x0, a0)
            a1 = fmadd(y, x1, a1)
            y = load_f32x8(q1, i)
            a2 = fmadd(y, x0, a2)
            a3 = fmadd(y, x1, a3)
            y = load_f32x8(q2, i)
            a4 = fmadd(y, x0, a4)
            a5 = fmadd(y, x1, a5)
            y = load_f32x8(q3, i)
            a6 = fmadd(y, x0, a6)
            a7 = fmadd(y, x1, a7)
        store_f32x8(lanes, 0, sums8_f32(a0, a1, a2, a3, a4, a5, a6, a7))
        c = j - start
        for r in range(4):
            scores[row + r, c] = lanes[2 * r]
            scores[row + r, c + 1] = lanes[2 * r + 1]
        j += 2
    if j < hi:
        c = j - start
        key = keys[kv, j]
        scores[row, c] = _dot(q0, key, head_dim)
        scores[row + 1, c] = _dot(q1, key, head_dim)
        scores[row + 2, c] = _dot(q2, key, head_dim)
        scores[row + 3, c] = _dot(q3, key, head_dim)


@njit(inline="always", cache=True)
def _softmax_block(scores, row, lo, hi, scale, softcap, running_max, running_sum, acc):
    """Turn a row's raw scores of keys lo..hi-1 (block columns) into e^(s - max), zero the
    columns it does not see, and rescale its sum and output to the new running maximum. Eight
    lanes at a time, written out: the loop vectorizer leaves max and floor scalar."""
    s = scores[row]
    if softcap > 0:
        for j in range(lo, hi):
            s[j] = softcap * np.tanh(s[j] * scale / softcap)
    top = splat_f32(-np.inf)
    for c in range(0, KEY_BLOCK, 8):
        x = load_f32x8(s, c)
        if softcap <= 0:
            x = mul_f32(x, splat_f32(scale))
        x = keep_lanes_f32(x, c, lo, hi, -np.inf)
        store_f32x8(s, c, x)
        top = max_f32(top, x)
    new_max = max(running_max[row], max_lane_f32(top))
    correction = exp_nonpositive(running_max[row] - new_max)
    running_max[row] = new_max
    for c in range(0, KEY_BLOCK, 8):
        p = exp_nonpositive8(sub_f32(load_f32x8(s, c), splat_f32(new_max)))
        store_f32x8(s, c, keep_lanes_f32(p, c, lo, hi, 0.0))
    running_sum[row] = running_sum[row] * correction + _block_sum(s)
    out = acc[row]
    for i in range(0, out.shape[0], 8):
        store_f32x8(out, i, mul_f32(load_f32x8(out, i), splat_f32(correction)))


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


@njit(inline="always", cache=True)
def _add_values_tile(values, kv, lo, hi, start, scores, row, acc):
    """``_add_values`` for four rows (row..row+3) at once, 16 values at a time: each value's
    load serves four rows. A row's weights outside its own keys are 0, which adds nothing, so
    every output's sum runs over the same keys in the same order as alone."""
    value_dim = values.shape[2]
    o0, o1, o2, o3 = acc[row], acc[row + 1], acc[row + 2], acc[row + 3]
    for i in range(0, value_dim, 16):
        a0, a1, a2, a3 = load_f32x8(o0, i), load_f32x8(o0, i + 8), load_f32x8(o1, i), load_f32x8(o1, i + 8)
        a4, a5, a6, a7 = load_f32x8(o2, i), load_f32x8(o2, i + 8), load_f32x8(o3, i), load_f32x8(o3, i + 8)
        for j in range(lo, hi):
            v = values[kv, j]
            x0, x1 = load_kv8(v, i), load_kv8(v, i + 8)
            c = j - start
            p = splat_f32(scores[row, c])
            a0 = fmadd(p, x0, a0)
            a1 = fmadd(p, x1, a1)
            p = splat_f32(scores[row + 1, c])
            a2 = fmadd(p, x0, a2)
            a3 = fmadd(p, x1, a3)
            p = splat_f32(scores[row + 2, c])
            a4 = fmadd(p, x0, a4)
            a5 = fmadd(p, x1, a5)
            p = splat_f32(scores[row + 3, c])
            a6 = fmadd(p, x0, a6)
            a7 = fmadd(p, x1, a7)
        store_f32x8(o0, i, a0)
        store_f32x8(o0, i + 8, a1)
        store_f32x8(o1, i, a2)
        store_f32x8(o1, i + 8, a3)
        store_f32x8(o2, i, a4)
        store_f32x8(o2, i + 8, a5)
        store_f32x8(o3, i, a6)
        store_f32x8(o3, i + 8, a7)


# Every fast-math licence but reassociation: the tiles and the single rows must add in the
# orders written (lanes, then a fixed tree), which a reassociating compiler would change.
@njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"}, nogil=True, cache=True)
def causal_attention(q, keys, values, first_pos, scale, window, softcap, out):
    """q [T, H, d]; keys [K, L, d]; values [K, L, dv] with L = first_pos + T; out [T, H*dv].
    d must be a multiple of 8, dv of 16; the last axis of each array contiguous. Keys and
    values are float32, or uint16 holding IEEE halves (an f16 cache).

    Query t (at position first_pos + t) sees key j iff j <= first_pos + t and, when window > 0,
    first_pos + t - j < window. softcap > 0 replaces a score s by softcap * tanh(s / softcap).

    A task's rows are (token, head of the group) in token order; each key block goes through
    three passes over them: raw scores, four rows at a time; the online softmax, row by row;
    the value sums, four rows at a time. Rows left over from fours go one by one, through the
    same arithmetic.
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
        tiled = rows - rows % 4
        scores = np.empty((rows, KEY_BLOCK), dtype=np.float32)
        lanes = np.empty(8, dtype=np.float32)
        acc = np.zeros((rows, value_dim), dtype=np.float32)
        running_max = np.full(rows, -np.inf, dtype=np.float32)
        running_sum = np.zeros(rows, dtype=np.float32)
        lowest = max(0, first_pos + t0 - window + 1) if window > 0 else 0
        last = first_pos + t1 - 1
        for start in range(lowest - lowest % KEY_BLOCK, last + 1, KEY_BLOCK):
            # rows are in token order and a span's ends grow with the position: the keys a
            # tile's rows may see run from its first row's lo to its last row's hi
            for row in range(0, tiled, 4):
                lo = _span(start, first_pos + t0 + row // group, window)[0]
                hi = _span(start, first_pos + t0 + (row + 3) // group, window)[1]
                if lo < hi:
                    _raw_scores_tile(q[t0 + row // group, kv * group + row % group],
                                     q[t0 + (row + 1) // group, kv * group + (row + 1) % group],
                                     q[t0 + (row + 2) // group, kv * group + (row + 2) % group],
                                     q[t0 + (row + 3) // group, kv * group + (row + 3) % group],
                                     keys, kv, lo, hi, start, scores, row, lanes)
            for row in range(tiled, rows):
                lo, hi = _span(start, first_pos + t0 + row // group, window)
                if lo < hi:
                    _raw_scores(q[t0 + row // group, kv * group + row % group], keys, kv, lo, hi, start, scores,
                                row)
            for row in range(rows):
                lo, hi = _span(start, first_pos + t0 + row // group, window)
                if lo < hi:
                    _softmax_block(scores, row, lo - start, hi - start, scale, softcap, running_max, running_sum,
                                   acc)
                else:  # no key of this block: its weights are 0 for the tiles' value sums
                    scores[row, :] = 0.0
            for row in range(0, tiled, 4):
                lo = _span(start, first_pos + t0 + row // group, window)[0]
                hi = _span(start, first_pos + t0 + (row + 3) // group, window)[1]
                if lo < hi:
                    _add_values_tile(values, kv, lo, hi, start, scores, row, acc)
            for row in range(tiled, rows):
                lo, hi = _span(start, first_pos + t0 + row // group, window)
                if lo < hi:
                    _add_values(values, kv, lo, hi, start, scores, row, acc)
        for t in range(t0, t1):
            for g in range(group):
                row = (t - t0) * group + g
                h = kv * group + g
                inverse = np.float32(1.0) / running_sum[row]
                for i in range(value_dim):
                    out[t, h * value_dim + i] = acc[row, i] * inverse
    return out


@njit(nogil=True, cache=True)
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
