"""Causal grouped-query attention over a KV cache, compiled, with an online softmax.

A task is one KV head and a block of up to QUERY_BLOCK query positions, with the G query heads
that read that KV head (its *rows*): each key and value is widened from the cache once for all
of them. Keys go in blocks of KEY_BLOCK at fixed positions (0, 64, 128, ...); the running
maximum, sum and output of each row are rescaled when a block raises the maximum, so no [T, L]
score matrix is built and memory stays flat as the context grows. Sliding windows limit the
keys a row sees; a logit softcap bends scores through tanh.

The key cache holds its keys in *runs* of RUN positions, each run dim by dim (the RUN keys'
dim 0 side by side, then their dim 1, ...: ``kv_cache.key_runs``), so a vector of keys is one
load. Per key block, in float32 and WIDTH lanes (``wide_simd.py``: 16 with AVX-512, else 8):

* the block's keys are widened into scratch as they lie (a row per dim, the keys across it),
  its values into scratch rows (dims padded with zeros);
* scores, four rows by SCORE_GROUPS · WIDTH keys at a time, the keys in lanes. A score is
  defined as Σ q[d]·k[d], one fused multiply-add after another from d = 0, in one lane. A
  task of few rows (a decode step) reads the runs in place instead, two rows at a time: the
  same operations on the same numbers;
* the online softmax, row by row;
* the weighted values, four rows at a time: each output dim sums its keys in order.

Each row's arithmetic depends only on its own position and the cache, never on which other
rows share its task or call: a prompt computed in one chunk or several, alone or in a batch,
gets the same bits (the int8 rounding of the next projection would magnify any difference
into a visible one). Rows are tiled by four; a part-full tile is padded with copies of its
last row, whose results are dropped.

Where the CPU has the tile unit with bfloat16 products (AMX-BF16, beside the AMX-INT8 the
GEMM takes), a call the caller marks as a prompt's rows (``tiled``: ``KVCache.prompt_rows``)
takes its products there instead (``_attend_task_tiles``): queries, keys, values and the
softmax's weights rounded to bfloat16, products exact and summed in float32, 16 rows at a time,
tasks of TILE_QUERY_BLOCK positions where there are enough of them (``task_positions``); its
softmax works in log2 units (``_weigh_rows``: a polynomial and ``vscalefps`` for 2^x,
``vcvtneps2bf16`` for the rounding). Its key blocks are TILE_KEY_BLOCK long, twice the loops':
each tile of output sums is loaded and stored once a block, and a 512-query chunk at 16k took
99-101 ms of one core against 114-119 ms with blocks of 64 (a key cache holds whole blocks of
either length: ``KEYS_WHOLE``). Its scratch starts on cache lines (``tiles.lined``). At a
16k-token context it attended about 4x as fast as the float32 loops already with blocks of 64
(a Qwen3-0.6B layer's 512-query chunk on 2 cores of a Xeon, Emerald Rapids), whose AVX-512
``vdpbf16ps`` there ran at half the multiply-adds a cycle of float32 FMAs. It is a path of its
own, not bit for bit the loops': every prompt row takes it in any chunk, and decode steps and
verified drafts keep the loops (a step's 16-row tile of a few rows' keys rounded afresh each
time took 2.5x as long), so a greedy stream reads the same alone, batched or speculated, and a
prompt sent again (or its last token recomputed) reads as before.

The parallel loop (``causal_attention``) calls each task where it is compiled
(``task_addresses``), not linked into it, so that it and its callers compile in seconds less,
and a first start compiles each task in a helper process of its own (``compile_ahead``).
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import from_dtype, njit, prange, types
from numba.extending import intrinsic

from worker.engine.kernels import target_has, tiles, use_tiles
from worker.engine.kernels.simd import (add_f32, floor_f32, fmadd, load_f32x8, max_f32, mul_f32, pow2_f32,
                                        splat_f32, store_kv8, store_kv8_apart, sub_f32, sum_pairs_f32)
from worker.engine.kernels.wide_simd import (WIDTH, add_float, floor_floats, fma_float, keep_lanes, largest_lane,
                                             load_floats, load_widened, load_widened_all, max_float, mul_float,
                                             nearest_floats, pow2_floats, put_bf16, put_bf16_pairs, put_floats,
                                             scaled_by_pow2, splat_float, sub_float, to_eight, zeros_float)

KEY_BLOCK = 64
TILE_KEY_BLOCK = 128  # the tile unit's key blocks: half the passes over each tile of sums
KEYS_WHOLE = max(KEY_BLOCK, TILE_KEY_BLOCK)  # a key cache holds a whole number of these (paths read whole blocks)
RUN = 16  # keys in a run of the key cache, which holds them dim by dim (``kv_cache.key_runs``)
QUERY_BLOCK = 128
TILE_QUERY_BLOCK = 256  # the tile unit's tasks, where there are enough of them (``task_positions``)
TILE_TASKS = 8
TILE = 4  # rows a step of the scores and of the value sums takes
DIRECT_ROWS = 8  # a task of at most this many rows reads the cache in place (no widened scratch)


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
def key_span(start, pos, window, block):
    """The keys of the ``block`` keys from ``start`` that the query at ``pos`` sees: lo..hi-1."""
    lo = max(start, pos - window + 1) if window > 0 else start
    return lo, min(start + block, pos + 1)


@njit(inline="always", cache=True)
def _exp_lanes(x):
    """``exp_nonpositive8`` on WIDTH lanes."""
    t = mul_float(max_float(x, splat_float(-87.0)), splat_float(1.4426950408889634))
    n = floor_floats(add_float(t, splat_float(0.5)))
    f = sub_float(t, n)
    p = fma_float(splat_float(1.5252734e-5), f, splat_float(1.5403530e-4))
    p = fma_float(p, f, splat_float(1.3333558e-3))
    p = fma_float(p, f, splat_float(9.6181291e-3))
    p = fma_float(p, f, splat_float(5.5504109e-2))
    p = fma_float(p, f, splat_float(2.4022651e-1))
    p = fma_float(p, f, splat_float(6.9314718e-1))
    p = fma_float(p, f, splat_float(1.0))
    return mul_float(p, pow2_floats(n))


@njit(inline="always", cache=True)
def _widen_row(source, count, rows_out, r, chunks):
    """Row ``source`` (floats, or f16 bits), ``count`` values, as floats into ``rows_out[r]``,
    WIDTH a vector, zeros past ``count``."""
    out = rows_out[r]
    for c in range(chunks):
        put_floats(out, WIDTH * c, load_widened(source, WIDTH * c, max(0, min(WIDTH, count - WIDTH * c))))


@njit(inline="always", cache=True)
def _widen_runs(keys, base, head_dim, kt):
    """The key block whose first run starts at element ``base`` of ``keys`` (a KV head's runs,
    flattened) as floats in ``kt`` [head_dim, KEY_BLOCK]: row d holds dim d of the block's keys."""
    for g in range(KEY_BLOCK // RUN):
        run = base + g * head_dim * RUN
        for d in range(head_dim):
            for h in range(0, RUN, WIDTH):
                put_floats(kt, d * KEY_BLOCK + g * RUN + h, load_widened_all(keys, run + d * RUN + h))


@njit(inline="always", cache=True)
def _scores_four(qf, kt, r, g0, dims, scores):
    """Rows r..r+3 against the SCORE_GROUPS key groups from g0 (WIDTH keys each) of the widened
    block ``kt``: each score Σ q[d]·k[d], one fused multiply-add after another from d = 0, the
    keys in lanes."""
    at = g0 * WIDTH
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros_float()
    c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = zeros_float()
    for d in range(dims):
        row = d * KEY_BLOCK + at
        k0, k1 = load_floats(kt, row), load_floats(kt, row + WIDTH)
        if SCORE_GROUPS == 4:
            k2, k3 = load_floats(kt, row + 2 * WIDTH), load_floats(kt, row + 3 * WIDTH)
        else:
            k2, k3 = k0, k1
        a0, a1, a2, a3 = _row_step(qf[r, d], k0, k1, k2, k3, a0, a1, a2, a3)
        b0, b1, b2, b3 = _row_step(qf[r + 1, d], k0, k1, k2, k3, b0, b1, b2, b3)
        c0, c1, c2, c3 = _row_step(qf[r + 2, d], k0, k1, k2, k3, c0, c1, c2, c3)
        d0, d1, d2, d3 = _row_step(qf[r + 3, d], k0, k1, k2, k3, d0, d1, d2, d3)
    _put_groups(scores, r * KEY_BLOCK + at, a0, a1, a2, a3)
    _put_groups(scores, (r + 1) * KEY_BLOCK + at, b0, b1, b2, b3)
    _put_groups(scores, (r + 2) * KEY_BLOCK + at, c0, c1, c2, c3)
    _put_groups(scores, (r + 3) * KEY_BLOCK + at, d0, d1, d2, d3)


@njit(inline="always", cache=True)
def _row_step(q, k0, k1, k2, k3, a0, a1, a2, a3):
    """One dim's products of a row's query value with SCORE_GROUPS vectors of keys, added to its
    running scores."""
    q = splat_float(q)
    a0, a1 = fma_float(q, k0, a0), fma_float(q, k1, a1)
    if SCORE_GROUPS == 4:
        a2, a3 = fma_float(q, k2, a2), fma_float(q, k3, a3)
    return a0, a1, a2, a3


@njit(inline="always", cache=True)
def _group_at(base, g, dims):
    """Where key group g (WIDTH keys) of a block starts among its runs from element ``base``."""
    key = g * WIDTH
    return base + (key // RUN) * dims * RUN + key % RUN


@njit(inline="always", cache=True)
def _scores_two_in_place(qf, keys, base, r, g0, dims, scores):
    """``_scores_four`` for rows r, r+1, the keys read from the cache's runs where they are (a
    task of few rows: widening a block first would cost more than its scores); the same sums."""
    p0, p1 = _group_at(base, g0, dims), _group_at(base, g0 + 1, dims)
    p2, p3 = _group_at(base, g0 + 2, dims), _group_at(base, g0 + 3, dims)
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros_float()
    for d in range(dims):
        at = d * RUN
        k0, k1 = load_widened_all(keys, p0 + at), load_widened_all(keys, p1 + at)
        if SCORE_GROUPS == 4:
            k2, k3 = load_widened_all(keys, p2 + at), load_widened_all(keys, p3 + at)
        else:
            k2, k3 = k0, k1
        a0, a1, a2, a3 = _row_step(qf[r, d], k0, k1, k2, k3, a0, a1, a2, a3)
        b0, b1, b2, b3 = _row_step(qf[r + 1, d], k0, k1, k2, k3, b0, b1, b2, b3)
    _put_groups(scores, r * KEY_BLOCK + g0 * WIDTH, a0, a1, a2, a3)
    _put_groups(scores, (r + 1) * KEY_BLOCK + g0 * WIDTH, b0, b1, b2, b3)


@njit(inline="always", cache=True)
def _put_groups(out, at, x0, x1, x2, x3):
    """SCORE_GROUPS vectors of scores side by side from ``at``."""
    put_floats(out, at, x0)
    put_floats(out, at + WIDTH, x1)
    if SCORE_GROUPS == 4:
        put_floats(out, at + 2 * WIDTH, x2)
        put_floats(out, at + 3 * WIDTH, x3)


# key groups (WIDTH keys each) a step of the scores takes: sixteen accumulators where there are
# 32 registers, eight where there are 16
SCORE_GROUPS = 4 if WIDTH == 16 else 2
assert KEY_BLOCK % (SCORE_GROUPS * WIDTH) == 0 and KEY_BLOCK % RUN == 0 and RUN % WIDTH == 0


@njit(inline="always", cache=True)
def _softmax_rows(scores, position, start, window, scale, softcap, running_max, running_sum, acc):
    """Turn each row's raw scores over the key block from ``start`` into e^(s - max), zero the
    columns it does not see (every column, where it sees none), and rescale its sum and output to
    the new running maximum. The rows are a loop here, addressed in the whole arrays: a function
    or a view per row can cost reference counting per row (in the tile path's softmax it cost as
    much as the rest of the row's work)."""
    for row in range(scores.shape[0]):
        lo, hi = key_span(start, position[row], window, KEY_BLOCK)
        lo, hi = lo - start, hi - start
        at = row * KEY_BLOCK
        if lo >= hi:
            scores[row, :] = 0.0
            continue
        if softcap > 0:
            for j in range(lo, hi):
                scores[row, j] = softcap * np.tanh(scores[row, j] * scale / softcap)
        top = splat_float(-np.inf)
        for c in range(0, KEY_BLOCK, WIDTH):
            x = load_floats(scores, at + c)
            if softcap <= 0:
                x = mul_float(x, splat_float(scale))
            x = keep_lanes(x, c, lo, hi, -np.inf)
            put_floats(scores, at + c, x)
            top = max_float(top, x)
        new_max = max(running_max[row], largest_lane(top))
        correction = exp_nonpositive(running_max[row] - new_max)
        running_max[row] = new_max
        total = zeros_float()
        for c in range(0, KEY_BLOCK, WIDTH):
            p = keep_lanes(_exp_lanes(sub_float(load_floats(scores, at + c), splat_float(new_max))), c, lo, hi, 0.0)
            put_floats(scores, at + c, p)
            total = add_float(total, p)
        # the block's weights, folded to eight lanes, then added in one fixed tree
        running_sum[row] = running_sum[row] * correction + sum_pairs_f32(to_eight(total))
        if correction != 1.0:  # a scale of exactly 1 changes nothing
            _rescale(acc, row, correction)


@njit(inline="always", cache=True)
def _rescale(acc, row, factor):
    """A row's output sums times ``factor``."""
    width = acc.shape[1]
    factor = splat_float(factor)
    for i in range(row * width, (row + 1) * width, WIDTH):
        put_floats(acc, i, mul_float(load_floats(acc, i), factor))


LOG2E = np.float32(1.4426950408889634)


@njit(inline="always", cache=True)
def _exp2_lanes(t):
    """2^t per lane for t <= 0, to a relative 3e-6 (far inside a bfloat16's step): t = n + f with
    n whole and |f| <= 1/2, 2^f by a polynomial fitted to it, n put in by ``vscalefps``."""
    n = nearest_floats(t)
    f = sub_float(t, n)
    p = fma_float(splat_float(0.009560510516166687), f, splat_float(0.05591703951358795))
    p = fma_float(p, f, splat_float(0.24024981260299683))
    p = fma_float(p, f, splat_float(0.6931219696998596))
    p = fma_float(p, f, splat_float(0.9999991655349731))
    return scaled_by_pow2(p, n)


@njit(inline="always", cache=True)
def _weigh_rows(scores, position, start, window, scale, softcap, running_max, running_sum, acc, weights):
    """``_softmax_rows`` for the tile unit's path, in log2 units: weights 2^(s · scale · log2(e) -
    max), the scaling one fused multiply-add with the maximum's subtraction, rounded to bfloat16
    into ``weights`` (0 where a row does not see a key), the sum adding them unrounded. A row's
    running maximum (of its scaled scores), sum and output move only when a block raises that
    maximum, and a row that sees the whole block skips the masks."""
    factor = scale * LOG2E
    for row in range(scores.shape[0]):
        lo, hi = key_span(start, position[row], window, TILE_KEY_BLOCK)
        lo, hi = lo - start, hi - start
        at = row * TILE_KEY_BLOCK
        if lo >= hi:
            weights[row, :] = 0
            continue
        if softcap > 0:  # capped, and put back in the scores' units
            for j in range(lo, hi):
                scores[row, j] = softcap * np.tanh(scores[row, j] * scale / softcap) / scale
        whole = lo == 0 and hi == TILE_KEY_BLOCK
        top = splat_float(-np.inf)
        for c in range(0, TILE_KEY_BLOCK, WIDTH):
            x = load_floats(scores, at + c)
            top = max_float(top, x if whole else keep_lanes(x, c, lo, hi, -np.inf))
        new_max = largest_lane(top) * factor  # scale > 0: the largest score, scaled
        if new_max > running_max[row]:
            correction = exp_nonpositive((running_max[row] - new_max) / LOG2E)
            running_max[row] = new_max
            running_sum[row] *= correction
            _rescale(acc, row, correction)
        times, shift = splat_float(factor), splat_float(-running_max[row])
        total = zeros_float()
        for c in range(0, TILE_KEY_BLOCK, WIDTH):
            p = _exp2_lanes(fma_float(load_floats(scores, at + c), times, shift))
            if not whole:
                p = keep_lanes(p, c, lo, hi, 0.0)
            put_bf16(weights, at + c, p)
            total = add_float(total, p)
        running_sum[row] += sum_pairs_f32(to_eight(total))


@njit(inline="always", cache=True)
def _tile_span(start, position, r, tile, window, block):
    """The keys of the ``block`` keys from ``start`` that rows r..r+tile-1 may see: from the first
    row's lo to the last row's hi (rows are in token order, and a span's ends grow with the
    position)."""
    return (key_span(start, position[r], window, block)[0],
            key_span(start, position[r + tile - 1], window, block)[1])


@njit(inline="always", cache=True)
def _write_rows(out, acc, running_sum, rows, t0, kv, group, value_dim):
    """Each real row's output, its sums divided by its weights' sum, into ``out`` [T, H*dv]."""
    for r in range(rows):
        t = t0 + r // group
        h = kv * group + r % group
        inverse = np.float32(1.0) / running_sum[r]
        for i in range(value_dim):
            out[t, h * value_dim + i] = acc[r, i] * inverse


@njit(inline="always", cache=True)
def _add_values_two(vf, weights, r, first_key, last_key, acc, c):
    """acc[r..r+3] dims of step c (VALUE_STEP · WIDTH dims, here 2 · WIDTH) += Σ_j weight ·
    value over keys first_key..last_key-1 in order (a row's weights outside its own keys are 0,
    adding nothing)."""
    at = VALUE_STEP * WIDTH * c
    o0, o1, o2, o3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
    a0, a1 = load_floats(o0, at), load_floats(o0, at + WIDTH)
    a2, a3 = load_floats(o1, at), load_floats(o1, at + WIDTH)
    a4, a5 = load_floats(o2, at), load_floats(o2, at + WIDTH)
    a6, a7 = load_floats(o3, at), load_floats(o3, at + WIDTH)
    for j in range(first_key, last_key):
        v0, v1 = load_floats(vf[j], at), load_floats(vf[j], at + WIDTH)
        p = splat_float(weights[r, j])
        a0, a1 = fma_float(p, v0, a0), fma_float(p, v1, a1)
        p = splat_float(weights[r + 1, j])
        a2, a3 = fma_float(p, v0, a2), fma_float(p, v1, a3)
        p = splat_float(weights[r + 2, j])
        a4, a5 = fma_float(p, v0, a4), fma_float(p, v1, a5)
        p = splat_float(weights[r + 3, j])
        a6, a7 = fma_float(p, v0, a6), fma_float(p, v1, a7)
    put_floats(o0, at, a0)
    put_floats(o0, at + WIDTH, a1)
    put_floats(o1, at, a2)
    put_floats(o1, at + WIDTH, a3)
    put_floats(o2, at, a4)
    put_floats(o2, at + WIDTH, a5)
    put_floats(o3, at, a6)
    put_floats(o3, at + WIDTH, a7)


@njit(inline="always", cache=True)
def _add_values_four(vf, weights, r, first_key, last_key, acc, c):
    """``_add_values_two`` over 4 · WIDTH dims a step: sixteen accumulators (of AVX-512's 32
    registers) against four loads and four broadcasts a key, the same sums."""
    at = VALUE_STEP * WIDTH * c
    o0, o1, o2, o3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
    a0, a1, a2, a3 = load_floats(o0, at), load_floats(o0, at + WIDTH), load_floats(o0, at + 2 * WIDTH), \
        load_floats(o0, at + 3 * WIDTH)
    b0, b1, b2, b3 = load_floats(o1, at), load_floats(o1, at + WIDTH), load_floats(o1, at + 2 * WIDTH), \
        load_floats(o1, at + 3 * WIDTH)
    c0, c1, c2, c3 = load_floats(o2, at), load_floats(o2, at + WIDTH), load_floats(o2, at + 2 * WIDTH), \
        load_floats(o2, at + 3 * WIDTH)
    d0, d1, d2, d3 = load_floats(o3, at), load_floats(o3, at + WIDTH), load_floats(o3, at + 2 * WIDTH), \
        load_floats(o3, at + 3 * WIDTH)
    for j in range(first_key, last_key):
        row = vf[j]
        v0, v1, v2, v3 = load_floats(row, at), load_floats(row, at + WIDTH), load_floats(row, at + 2 * WIDTH), \
            load_floats(row, at + 3 * WIDTH)
        p = splat_float(weights[r, j])
        a0, a1, a2, a3 = fma_float(p, v0, a0), fma_float(p, v1, a1), fma_float(p, v2, a2), fma_float(p, v3, a3)
        p = splat_float(weights[r + 1, j])
        b0, b1, b2, b3 = fma_float(p, v0, b0), fma_float(p, v1, b1), fma_float(p, v2, b2), fma_float(p, v3, b3)
        p = splat_float(weights[r + 2, j])
        c0, c1, c2, c3 = fma_float(p, v0, c0), fma_float(p, v1, c1), fma_float(p, v2, c2), fma_float(p, v3, c3)
        p = splat_float(weights[r + 3, j])
        d0, d1, d2, d3 = fma_float(p, v0, d0), fma_float(p, v1, d1), fma_float(p, v2, d2), fma_float(p, v3, d3)
    _put_four(o0, at, a0, a1, a2, a3)
    _put_four(o1, at, b0, b1, b2, b3)
    _put_four(o2, at, c0, c1, c2, c3)
    _put_four(o3, at, d0, d1, d2, d3)


@njit(inline="always", cache=True)
def _put_four(out, at, x0, x1, x2, x3):
    put_floats(out, at, x0)
    put_floats(out, at + WIDTH, x1)
    put_floats(out, at + 2 * WIDTH, x2)
    put_floats(out, at + 3 * WIDTH, x3)


# the value sums' step: as many dims as sixteen accumulators hold where there are 32 registers
VALUE_STEP = 4 if WIDTH == 16 else 2
_add_values = _add_values_four if VALUE_STEP == 4 else _add_values_two


@njit(inline="always", cache=True)
def _add_values_from_cache(values, kv, start, weights, r, first_key, last_key, acc):
    """``_add_values`` for rows r, r+1 over every value dim, the values read from the cache
    where they are (few rows): each output dim sums its keys in the same order."""
    value_dim = values.shape[2]
    o0, o1 = acc[r], acc[r + 1]
    for at in range(0, acc.shape[1], 2 * WIDTH):
        a0, a1 = load_floats(o0, at), load_floats(o0, at + WIDTH)
        a2, a3 = load_floats(o1, at), load_floats(o1, at + WIDTH)
        for j in range(first_key, last_key):
            v = values[kv, start + j]
            v0 = load_widened(v, at, max(0, min(WIDTH, value_dim - at)))
            v1 = load_widened(v, at + WIDTH, max(0, min(WIDTH, value_dim - at - WIDTH)))
            p = splat_float(weights[r, j])
            a0, a1 = fma_float(p, v0, a0), fma_float(p, v1, a1)
            p = splat_float(weights[r + 1, j])
            a2, a3 = fma_float(p, v0, a2), fma_float(p, v1, a3)
        put_floats(o0, at, a0)
        put_floats(o0, at + WIDTH, a1)
        put_floats(o1, at, a2)
        put_floats(o1, at + WIDTH, a3)


@njit(inline="always", cache=True)
def _task_at(task, n_tokens, n_kv, positions):
    """The KV head and the query positions t0..t1-1 of a task, in blocks of ``positions``."""
    query_blocks = (n_tokens + positions - 1) // positions
    # blocks in the order first, last, second, second last, ...: later queries see more
    # keys, and each thread takes a contiguous run of tasks
    order = task // n_kv
    block = order // 2 if order % 2 == 0 else query_blocks - 1 - order // 2
    t0 = block * positions
    return task % n_kv, t0, min(n_tokens, t0 + positions)


# No reassociation: rows must add in the orders written, which a reassociating compiler would
# change; and infinities are real here (a running maximum starts at -inf).
@njit(fastmath={"nsz", "arcp", "contract", "afn"}, nogil=True, cache=True)
def _attend_task(q, keys, values, first_pos, scale, window, softcap, out, task):
    """One task of ``causal_attention``: a KV head and a block of query positions."""
    n_tokens, n_head, head_dim = q.shape
    n_kv = keys.shape[0]
    n_keys = values.shape[1]
    value_dim = values.shape[2]
    group = n_head // n_kv
    v_steps = (value_dim + VALUE_STEP * WIDTH - 1) // (VALUE_STEP * WIDTH)  # the value sums' steps
    kv, t0, t1 = _task_at(task, n_tokens, n_kv, QUERY_BLOCK)
    rows = (t1 - t0) * group
    # a task of few rows (a decode step) reads keys and values where they are, two rows at
    # a time; more rows share each block widened once into scratch, four at a time
    direct = rows <= DIRECT_ROWS
    tile = 2 if direct else TILE
    padded = rows + (-rows) % tile
    # row r is token t0 + r // group, head kv * group + r % group; padding repeats the last row
    position = np.empty(padded, dtype=np.int64)
    qf = np.empty((padded, head_dim), dtype=np.float32)
    for r in range(padded):
        real = min(r, rows - 1)
        position[r] = first_pos + t0 + real // group
        qf[r] = q[t0 + real // group, kv * group + real % group]
    key_runs = keys[kv].reshape(-1)  # the head's runs, one after another
    kt = tiles.lined((0 if direct else head_dim) * KEY_BLOCK, np.float32).reshape((-1, KEY_BLOCK))
    vf = tiles.lined((0 if direct else KEY_BLOCK) * VALUE_STEP * WIDTH * v_steps,
                np.float32).reshape((-1, VALUE_STEP * WIDTH * v_steps))
    scores = tiles.lined(padded * KEY_BLOCK, np.float32).reshape((padded, KEY_BLOCK))
    acc = tiles.lined(padded * VALUE_STEP * WIDTH * v_steps,
                      np.float32).reshape((padded, VALUE_STEP * WIDTH * v_steps))
    acc[:] = 0
    running_max = np.full(padded, -np.inf, dtype=np.float32)
    running_sum = np.zeros(padded, dtype=np.float32)
    lowest = max(0, first_pos + t0 - window + 1) if window > 0 else 0
    last = first_pos + t1 - 1
    for start in range(lowest - lowest % KEY_BLOCK, last + 1, KEY_BLOCK):
        count = min(KEY_BLOCK, n_keys - start)
        base = start * head_dim  # the block's first run: start // RUN runs of RUN · head_dim values
        if not direct:
            _widen_runs(key_runs, base, head_dim, kt)
            for j in range(KEY_BLOCK):
                present = j < count
                _widen_row(values[kv, start + j] if present else values[kv, start], value_dim if present else 0,
                           vf, j, VALUE_STEP * v_steps)
        for r in range(0, padded, tile):
            lo, hi = _tile_span(start, position, r, tile, window, KEY_BLOCK)
            if lo >= hi:
                continue
            first_group = (lo - start) // WIDTH
            for g0 in range(first_group - first_group % SCORE_GROUPS, (hi - start + WIDTH - 1) // WIDTH,
                            SCORE_GROUPS):
                if direct:
                    _scores_two_in_place(qf, key_runs, base, r, g0, head_dim, scores)
                else:
                    _scores_four(qf, kt, r, g0, head_dim, scores)
        _softmax_rows(scores, position, start, window, scale, softcap, running_max, running_sum, acc)
        for r in range(0, padded, tile):
            lo, hi = _tile_span(start, position, r, tile, window, KEY_BLOCK)
            if lo < hi and direct:
                _add_values_from_cache(values, kv, start, scores, r, lo - start, hi - start, acc)
            elif lo < hi:
                for c in range(v_steps):
                    _add_values(vf, scores, r, lo - start, hi - start, acc, c)
    _write_rows(out, acc, running_sum, rows, t0, kv, group, value_dim)


@njit(fastmath={"nsz", "arcp", "contract", "afn"}, nogil=True, cache=True)
def _attend_task_tiles(q, keys, values, first_pos, scale, window, softcap, out, task, positions):
    """``_attend_task`` with its products in the tile unit, in bfloat16, for a prompt's rows: a
    task of ``positions`` query positions, its rows in tiles of 16 (the last padded with copies of
    its last row), a chunk of one token too.

    Per key block, its keys and values are rounded to bfloat16 into the pairs B rows hold: for
    the scores, key group g (one run of the cache, 16 keys) as head_dim / 2 rows of each key's
    dims 2p, 2p+1; for the value sums, each half of the block (32 keys) and each 16 value dims
    as 16 rows of keys 2k, 2k+1 of each dim (zeros past the cache's keys). The queries are
    rounded once, and each row's softmax weights as the softmax makes them. A 16 × 16 tile of
    scores is head_dim / 32 products, a tile of outputs gains a product per half block its rows
    see: a row's sums take the same products in the same order whichever rows share its tile,
    and a key it does not see adds an exact 0."""
    n_tokens, n_head, head_dim = q.shape
    n_kv = keys.shape[0]
    n_keys = values.shape[1]
    value_dim = values.shape[2]
    group = n_head // n_kv
    pairs = head_dim // 2
    value_tiles = value_dim // 16
    kv, t0, t1 = _task_at(task, n_tokens, n_kv, positions)
    rows = (t1 - t0) * group
    padded = rows + (-rows) % tiles.ROWS
    position = np.empty(padded, dtype=np.int64)
    queries = tiles.lined(padded * head_dim, np.uint16).reshape((padded, head_dim))
    for r in range(padded):
        real = min(r, rows - 1)
        position[r] = first_pos + t0 + real // group
        row = q[t0 + real // group, kv * group + real % group]
        for i in range(0, head_dim, WIDTH):
            put_bf16(queries[r], i, load_floats(row, i))
    key_runs = keys[kv].reshape(-1)
    head_values = values[kv]  # its rows addressed in the whole: a view per key would cost reference counting
    value_stride = head_values.strides[0] // head_values.itemsize
    key_pairs = tiles.lined(TILE_KEY_BLOCK * head_dim, np.uint16)
    value_pairs = tiles.lined(TILE_KEY_BLOCK * value_dim, np.uint16)
    scores = tiles.lined(padded * TILE_KEY_BLOCK, np.float32).reshape((padded, TILE_KEY_BLOCK))
    weights = tiles.lined(padded * TILE_KEY_BLOCK, np.uint16).reshape((padded, TILE_KEY_BLOCK))
    acc = tiles.lined(padded * value_dim, np.float32).reshape((padded, value_dim))
    acc[:] = 0
    running_max = np.full(padded, -np.inf, dtype=np.float32)
    running_sum = np.zeros(padded, dtype=np.float32)
    lowest = max(0, first_pos + t0 - window + 1) if window > 0 else 0
    last = first_pos + t1 - 1
    tiles.configure(_TILE_CONFIGURATION)
    for start in range(lowest - lowest % TILE_KEY_BLOCK, last + 1, TILE_KEY_BLOCK):
        count = min(TILE_KEY_BLOCK, n_keys - start)
        base = start * head_dim
        for g in range(TILE_KEY_BLOCK // RUN):
            run = base + g * head_dim * RUN
            for d in range(pairs):
                put_bf16_pairs(key_pairs, (g * pairs + d) * 2 * RUN, load_widened_all(key_runs, run + 2 * d * RUN),
                               load_widened_all(key_runs, run + (2 * d + 1) * RUN))
        for j in range(0, TILE_KEY_BLOCK, 2):
            first, second = min(start + j, n_keys - 1) * value_stride, min(start + j + 1, n_keys - 1) * value_stride
            for n in range(value_tiles):
                at = ((j // 32 * value_tiles + n) * 16 + j % 32 // 2) * 32
                put_bf16_pairs(value_pairs, at, load_widened(head_values, first + 16 * n, 16 if j < count else 0),
                               load_widened(head_values, second + 16 * n, 16 if j + 1 < count else 0))
        for r in range(0, padded, tiles.ROWS):
            lo, hi = _tile_span(start, position, r, tiles.ROWS, window, TILE_KEY_BLOCK)
            if lo >= hi:
                continue
            for g in range((lo - start) // RUN, (hi - start + RUN - 1) // RUN):
                tiles.zero_sums()
                for step in range(head_dim // 32):
                    tiles.add_bf16_product(queries, 2 * (r * head_dim + 32 * step), 2 * head_dim, key_pairs,
                                           64 * (g * pairs + 16 * step))
                tiles.store_sums(scores, 4 * (r * TILE_KEY_BLOCK + RUN * g), 4 * TILE_KEY_BLOCK)
        _weigh_rows(scores, position, start, window, scale, softcap, running_max, running_sum, acc, weights)
        for r in range(0, padded, tiles.ROWS):
            lo, hi = _tile_span(start, position, r, tiles.ROWS, window, TILE_KEY_BLOCK)
            if lo >= hi:
                continue
            for n in range(value_tiles):
                tiles.load_sums(acc, 4 * (r * value_dim + 16 * n), 4 * value_dim)
                for half in range((lo - start) // 32, (hi - start + 31) // 32):
                    tiles.add_bf16_product(weights, 2 * (r * TILE_KEY_BLOCK + 32 * half), 2 * TILE_KEY_BLOCK,
                                           value_pairs, 64 * 16 * (half * value_tiles + n))
                tiles.store_sums(acc, 4 * (r * value_dim + 16 * n), 4 * value_dim)
    tiles.release()
    _write_rows(out, acc, running_sum, rows, t0, kv, group, value_dim)


@njit(inline="always", cache=True)
def _takes_tiles(q, values, tiled):
    """Whether a call's rows take the tile unit: this CPU has it (``TILED``), the caller marks them
    a prompt's, and the heads' sizes suit its tiles."""
    return TILED and tiled and q.shape[2] % 32 == 0 and values.shape[2] % 16 == 0


@njit(inline="always", cache=True)
def task_positions(q, n_kv, values, tiled):
    """Query positions a task takes: the tile unit's TILE_QUERY_BLOCK (its rows share the rounding
    of each key block) where that still makes TILE_TASKS tasks, else QUERY_BLOCK (a chunk of 256
    on gemma-3's one KV head: two tasks, not one). A row's bits do not depend on which rows share
    its task. (The thread count itself, read here, would keep numba from caching the kernel.)"""
    blocks = (q.shape[0] + TILE_QUERY_BLOCK - 1) // TILE_QUERY_BLOCK
    if _takes_tiles(q, values, tiled) and n_kv * blocks >= TILE_TASKS:
        return TILE_QUERY_BLOCK
    return QUERY_BLOCK


@njit(inline="always", cache=True)
def _task(q, keys, values, first_pos, scale, window, softcap, out, task, tiled, positions, tasks):
    """The tile unit's task where ``_takes_tiles``, the vector loops' otherwise, each where
    ``tasks`` says it is (``task_addresses``)."""
    if _takes_tiles(q, values, tiled):
        _call_task(tasks[1], (q, keys, values, first_pos, scale, window, softcap, out, task, positions))
    else:
        _call_task(tasks[0], (q, keys, values, first_pos, scale, window, softcap, out, task))


# chosen here, as the GEMM's tiles are: where there is no tile unit, nothing that names one compiles
TILED = use_tiles() and target_has("amx-bf16")
_TILE_CONFIGURATION = tiles.ATTENTION_CONFIGURATION


def _task_types(kv, tiles: bool) -> tuple:
    """The argument types of a task over a cache whose arrays hold ``kv`` (a numba type): as
    ``store_and_attend`` passes them (values cut to the positions written: any layout), and
    a tile task's positions besides."""
    signature = (types.float32[:, :, ::1], kv[:, :, :, ::1], kv[:, :, :], types.int64, types.float32, types.int64,
                 types.float32, types.float32[:, ::1], types.int64)
    return signature + (types.int64,) * tiles


def task_signature(dtype: np.dtype, tiles: bool = False) -> tuple:
    """The types each task compiles for, over a cache whose kernel arrays (``kv_cache.kernel_view``)
    are of ``dtype``: one signature, whatever layout a caller's values have."""
    return _task_types(from_dtype(np.dtype(dtype)), tiles)


@functools.cache
def task_addresses(dtype: np.dtype) -> tuple[int, int]:
    """Where the tasks over a cache of ``dtype`` are compiled (loading them from numba's cache, or
    compiling them, the first time): the float32 loops' and the tile unit's (0 where this CPU has
    none). ``causal_attention`` calls them there, so its callers compile without them. numba
    links a callee into each caller and optimizes and compiles it again there, and the parallel
    loop alone makes four callers: with the tasks linked in, ``causal_attention`` and
    ``store_and_attend`` took 8 s of one core to compile on a Xeon; without, under 2 s."""
    return (_address(_attend_task, task_signature(dtype)),
            _address(_attend_task_tiles, task_signature(dtype, tiles=True)) if TILED else 0)


def _address(kernel, signature: tuple) -> int:
    kernel.compile(signature)
    compiled = kernel.overloads[signature]
    return compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)


@intrinsic
def _call_task(typingctx, address, arguments):
    """Call the task compiled at ``address`` (``task_addresses``) with the tuple ``arguments``,
    each cast to the type it compiled for (a layout to any, an integer's width)."""
    kv = arguments.types[1].dtype
    target = _task_types(kv, tiles=len(arguments) == 10)
    if len(arguments) not in (9, 10) or not all(typingctx.can_convert(given, wanted) is not None
                                                for given, wanted in zip(arguments.types, target)):
        return None

    def codegen(context, builder, signature, args):
        given = signature.args[1].types
        cast = [context.cast(builder, builder.extract_value(args[1], i), given[i], wanted)
                for i, wanted in enumerate(target)]
        function = context.call_conv.get_function_type(types.none, target)
        callee = builder.inttoptr(args[0], function.as_pointer())
        context.call_conv.call_function(builder, callee, types.none, target, cast)  # a task raises nothing
        return context.get_dummy_value()

    return types.none(address, arguments), codegen


@njit(parallel=True, nogil=True, cache=True)
def causal_attention(q, keys, values, first_pos, scale, window, softcap, out, tiled, tasks):
    """q [T, H, d]; keys [K, runs, d, RUN], the key cache's runs (``kv_cache.key_runs``), at
    least L keys and a whole number of key blocks of them; values [K, L, dv] with
    L = first_pos + T; out [T, H*dv]. Keys and values are float32, or uint16 holding IEEE
    halves (an f16 cache); values' last axis contiguous, keys C-ordered.

    Query t (at position first_pos + t) sees key j iff j <= first_pos + t and, when window > 0,
    first_pos + t - j < window. softcap > 0 replaces a score s by softcap * tanh(s / softcap).
    ``tiled``: the rows are a prompt's (``KVCache.prompt_rows``), which take the tile unit's
    bfloat16 path where this CPU has it (``TILED``); the float32 loops otherwise. ``tasks``:
    where those are compiled, ``task_addresses(values.dtype)``.
    """
    # the loop only hands out tasks: its body, compiled on its own, keeps numba's parallel
    # passes off the kernel (a first start compiles it in about half the time)
    positions = task_positions(q, keys.shape[0], values, tiled)
    query_blocks = (q.shape[0] + positions - 1) // positions
    for task in prange(keys.shape[0] * query_blocks):
        # (prange counts in uint64: one signature of the task, not two)
        _task(q, keys, values, first_pos, scale, window, softcap, out, np.int64(task), tiled, positions, tasks)
    return out


@njit(nogil=True, cache=True)
def store_and_attend(q, k, v, keys, values, first_pos, scale, window, softcap, out, tiled, tasks):
    """Write this step's k [T, K, d] and v [T, K, dv] at positions first_pos.. of a cache's
    keys [K, runs, d, RUN] (its runs) and values [K, capacity, dv] (float32 or f16 bits), then
    attend (``causal_attention``) over everything up to them."""
    n_tokens, n_kv, head_dim = k.shape
    value_dim = v.shape[2]
    for t in range(n_tokens):
        position = first_pos + t
        for h in range(n_kv):
            run, value = keys[h, position // RUN], values[h, position]
            for i in range(0, head_dim, 8):
                store_kv8_apart(run, i * RUN + position % RUN, RUN, load_f32x8(k[t, h], i))
            for i in range(0, value_dim, 8):
                store_kv8(value, i, load_f32x8(v[t, h], i))
    end = first_pos + n_tokens
    return causal_attention(q, keys, values[:, :end], first_pos, scale, window, softcap, out, tiled, tasks)
