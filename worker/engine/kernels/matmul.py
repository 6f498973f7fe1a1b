"""y = x Wᵀ with W in its file's block format, for m rows of x at once.

A row's result never depends on the rows beside it: the tiled and the single-row loops add in
the same order, so a stream's output is bit-identical alone and in a batch (int8 rounding
would turn the smallest difference into a visible one). Each thread takes a range of W's rows
(outputs); each weight unit is decoded once and
multiplied with four rows of x before the next is read, so a batch of up to 64 rows reads the
weights once, as one row does (a longer prefill chunk reads them once per 64 rows, from cache). Integer products accumulate per unit into eight float lanes that are
summed once per output.

``matmul_int8`` serves the 32-weight block types of ``blocks.py`` and ``matmul_super`` the
K-quants' 256-weight super-blocks (x quantized per 32 to int8 for both); ``matmul_float`` the
float types (F32, F16, BF16), with x as float32.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels import blocks
from worker.engine.kernels.simd import (fmadd, hadd_i32, join_halves_i32, load_bf16, load_bf16x8, load_f16,
                                        load_f16x8, load_f32, load_f32x8, load_f32x8_at, load_i8x32, mul_f32,
                                        splat_f32, sum_f32, to_f32, zeros_f32)

TILE = 4  # rows of x per pass over a weight row
CHUNK = 64  # rows of x per pass over the weights: their int8 values stay in the core's cache


@njit(inline="always", cache=True)
def _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r, acc, low):
    """Add one decoded weight unit (u) times the same unit of activation row r."""
    integer = to_f32(product(q, pair_scales, load_i8x32(values[r], u * 32)))
    return fmadd(splat_f32(scale * scales[r, u]), integer, acc), low + offset * sums[r, u]


@njit(inline="always", cache=True)
def _tile(decode, product, row, u, values, scales, sums, r, acc):
    """Unit u of a weight row times activation rows r..r+3."""
    a0, a1, a2, a3, l0, l1, l2, l3 = acc
    q, pair_scales, scale, offset = decode(row, u)
    a0, l0 = _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r, a0, l0)
    a1, l1 = _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r + 1, a1, l1)
    a2, l2 = _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r + 2, a2, l2)
    a3, l3 = _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r + 3, a3, l3)
    return a0, a1, a2, a3, l0, l1, l2, l3


@njit(inline="always", cache=True)
def _single(decode, product, row, u, values, scales, sums, r, acc, low):
    q, pair_scales, scale, offset = decode(row, u)
    return _apply(product, q, pair_scales, scale, offset, u, values, scales, sums, r, acc, low)


# Fused multiply-adds but no other fast-math: reassociating a row's sums (which the compiler
# does differently in the tiled and the single-row loops) would make a row's result depend on
# the rows beside it.
@njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def matmul_int8(decode, product, weights, values, scales, sums, out):
    """weights [n_out, row bytes] uint8; values [m, n] int8; scales, sums [m, n/32]; out [m, n_out].

    Units go eight at a time, written out (the loop's bookkeeping once per eight units). The
    tiled and the single-row loops add in the same order."""
    m = values.shape[0]
    units = values.shape[1] // 32
    for first in range(0, m, CHUNK):
        last = min(m, first + CHUNK)
        tiled = last - (last - first) % TILE
        for o in prange(weights.shape[0]):
            row = weights[o]
            for r in range(first, tiled, TILE):
                z = zeros_f32()
                acc = (z, z, z, z, np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0))
                u = 0
                while u + 8 <= units:
                    acc = _tile(decode, product, row, u, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 1, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 2, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 3, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 4, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 5, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 6, values, scales, sums, r, acc)
                    acc = _tile(decode, product, row, u + 7, values, scales, sums, r, acc)
                    u += 8
                while u < units:
                    acc = _tile(decode, product, row, u, values, scales, sums, r, acc)
                    u += 1
                a0, a1, a2, a3, l0, l1, l2, l3 = acc
                out[r, o] = sum_f32(a0) + l0
                out[r + 1, o] = sum_f32(a1) + l1
                out[r + 2, o] = sum_f32(a2) + l2
                out[r + 3, o] = sum_f32(a3) + l3
            for r in range(tiled, last):
                acc = zeros_f32()
                low = np.float32(0.0)
                u = 0
                while u + 8 <= units:
                    acc, low = _single(decode, product, row, u, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 1, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 2, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 3, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 4, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 5, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 6, values, scales, sums, r, acc, low)
                    acc, low = _single(decode, product, row, u + 7, values, scales, sums, r, acc, low)
                    u += 8
                while u < units:
                    acc, low = _single(decode, product, row, u, values, scales, sums, r, acc, low)
                    u += 1
                out[r, o] = sum_f32(acc) + low
    return out


@njit(inline="always", cache=True)
def _pair_sum(product, q0, pair_scales0, q1, pair_scales1, x, at):
    """Two adjacent units' integer products with one activation row (x, the units' first byte
    ``at``), adjacent lanes added: the first step of ``_unit_sums``."""
    return hadd_i32(product(q0, pair_scales0, load_i8x32(x, at)), product(q1, pair_scales1, load_i8x32(x, at + 32)))


@njit(inline="always", cache=True)
def _pair_tile(unit, product, row, s, j, values, r):
    """Units j and j+1 of super-block s (decoded once) times activation rows r..r+3."""
    q0, pair_scales0 = unit(row, s, j)
    q1, pair_scales1 = unit(row, s, j + 1)
    at = (8 * s + j) * 32
    return (_pair_sum(product, q0, pair_scales0, q1, pair_scales1, values[r], at),
            _pair_sum(product, q0, pair_scales0, q1, pair_scales1, values[r + 1], at),
            _pair_sum(product, q0, pair_scales0, q1, pair_scales1, values[r + 2], at),
            _pair_sum(product, q0, pair_scales0, q1, pair_scales1, values[r + 3], at))


@njit(inline="always", cache=True)
def _pair_single(unit, product, row, s, j, x):
    q0, pair_scales0 = unit(row, s, j)
    q1, pair_scales1 = unit(row, s, j + 1)
    return _pair_sum(product, q0, pair_scales0, q1, pair_scales1, x, (8 * s + j) * 32)


@njit(inline="always", cache=True)
def _unit_sums(pairs01, pairs23, pairs45, pairs67):
    """Lane j: the whole integer product of unit j (exact in int32, and in float32 after)."""
    return to_f32(join_halves_i32(hadd_i32(pairs01, pairs23), hadd_i32(pairs45, pairs67)))


@njit(inline="always", cache=True)
def _super_factors(scale, offset, scales, sums, r, s, low):
    """The eight units' factors for activation row r (weight scale times activation scale) and
    the offsets' contribution added to ``low``, lane by lane."""
    return mul_f32(scale, load_f32x8(scales[r], 8 * s)), fmadd(offset, load_f32x8(sums[r], 8 * s), low)


@njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def matmul_super(scales_of, unit, product, weights, values, scales, sums, out):
    """``matmul_int8`` for the K-quants' super-blocks of eight units: each super-block's scales
    and offsets are decoded once, as 8-lane vectors, and every row's eight factors (and offset
    terms) are one vector product; each unit's integer product is summed across its lanes in
    int32 (``_unit_sums``), so the eight units meet their eight factors in one multiply-add."""
    m = values.shape[0]
    supers = values.shape[1] // 256
    for first in range(0, m, CHUNK):
        last = min(m, first + CHUNK)
        tiled = last - (last - first) % TILE
        for o in prange(weights.shape[0]):
            row = weights[o]
            for r in range(first, tiled, TILE):
                z = zeros_f32()
                acc = (z, z, z, z)
                l0, l1, l2, l3 = z, z, z, z
                for s in range(supers):
                    scale, offset = scales_of(row, s)
                    f0, l0 = _super_factors(scale, offset, scales, sums, r, s, l0)
                    f1, l1 = _super_factors(scale, offset, scales, sums, r + 1, s, l1)
                    f2, l2 = _super_factors(scale, offset, scales, sums, r + 2, s, l2)
                    f3, l3 = _super_factors(scale, offset, scales, sums, r + 3, s, l3)
                    p01 = _pair_tile(unit, product, row, s, 0, values, r)
                    p23 = _pair_tile(unit, product, row, s, 2, values, r)
                    p45 = _pair_tile(unit, product, row, s, 4, values, r)
                    p67 = _pair_tile(unit, product, row, s, 6, values, r)
                    a0, a1, a2, a3 = acc
                    acc = (fmadd(f0, _unit_sums(p01[0], p23[0], p45[0], p67[0]), a0),
                           fmadd(f1, _unit_sums(p01[1], p23[1], p45[1], p67[1]), a1),
                           fmadd(f2, _unit_sums(p01[2], p23[2], p45[2], p67[2]), a2),
                           fmadd(f3, _unit_sums(p01[3], p23[3], p45[3], p67[3]), a3))
                a0, a1, a2, a3 = acc
                out[r, o] = sum_f32(a0) + sum_f32(l0)
                out[r + 1, o] = sum_f32(a1) + sum_f32(l1)
                out[r + 2, o] = sum_f32(a2) + sum_f32(l2)
                out[r + 3, o] = sum_f32(a3) + sum_f32(l3)
            for r in range(tiled, last):
                acc = zeros_f32()
                low = zeros_f32()
                for s in range(supers):
                    scale, offset = scales_of(row, s)
                    factor, low = _super_factors(scale, offset, scales, sums, r, s, low)
                    x = values[r]
                    acc = fmadd(factor, _unit_sums(_pair_single(unit, product, row, s, 0, x),
                                                   _pair_single(unit, product, row, s, 2, x),
                                                   _pair_single(unit, product, row, s, 4, x),
                                                   _pair_single(unit, product, row, s, 6, x)), acc)
                out[r, o] = sum_f32(acc) + sum_f32(low)
    return out


F32, F16, BF16 = 0, 1, 2  # the float kinds of ``matmul_float``


@njit(inline="always", cache=True)
def _float_weights(kind, row, e):
    """Weights e..e+7 of a row of float kind ``kind`` as 8 float32."""
    if kind == F32:
        return load_f32x8_at(row, 4 * e)
    if kind == F16:
        return load_f16x8(row, 2 * e)
    return load_bf16x8(row, 2 * e)


@njit(inline="always", cache=True)
def _float_weight(kind, row, e):
    """Weight e of a row of float kind ``kind``."""
    if kind == F32:
        return load_f32(row, 4 * e)
    if kind == F16:
        return load_f16(row, 2 * e)
    return load_bf16(row, 2 * e)


@njit(inline="always", cache=True)
def _float_tail(kind, row, x, vectors, n, acc):
    """The lanes' sum, then the weights past the last whole eight one by one."""
    total = sum_f32(acc)
    for e in range(vectors, n):
        total += _float_weight(kind, row, e) * x[e]
    return total


@njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def matmul_float(kind, weights, x, out):
    """weights [n_out, ...] holding n floats of ``kind`` per row (float32 rows, the records of
    ``weights.FLOAT_RECORDS``, or the file's bytes); x [m, n] float32. The kind's branch is the
    same for every weight, so it costs nothing. Each output sums eight lanes over the row,
    then the lanes in a fixed order, then the tail: the same in the tiled and single loops."""
    m, n = x.shape
    vectors = n - n % 8
    tiled = m - m % TILE
    for o in prange(weights.shape[0]):
        row = weights[o]
        for r in range(0, tiled, TILE):
            a0, a1, a2, a3 = zeros_f32(), zeros_f32(), zeros_f32(), zeros_f32()
            for e in range(0, vectors, 8):
                w = _float_weights(kind, row, e)
                a0 = fmadd(w, load_f32x8(x[r], e), a0)
                a1 = fmadd(w, load_f32x8(x[r + 1], e), a1)
                a2 = fmadd(w, load_f32x8(x[r + 2], e), a2)
                a3 = fmadd(w, load_f32x8(x[r + 3], e), a3)
            out[r, o] = _float_tail(kind, row, x[r], vectors, n, a0)
            out[r + 1, o] = _float_tail(kind, row, x[r + 1], vectors, n, a1)
            out[r + 2, o] = _float_tail(kind, row, x[r + 2], vectors, n, a2)
            out[r + 3, o] = _float_tail(kind, row, x[r + 3], vectors, n, a3)
        for r in range(tiled, m):
            acc = zeros_f32()
            for e in range(0, vectors, 8):
                acc = fmadd(_float_weights(kind, row, e), load_f32x8(x[r], e), acc)
            out[r, o] = _float_tail(kind, row, x[r], vectors, n, acc)
    return out


# One entry point per type: a kernel handed its decoder at call time would pay numba's typing
# of a function argument on every call (about 0.1 ms, more than a small matmul takes).

@njit(nogil=True, cache=True)
def matmul_q4_0(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q4_0, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q4_1(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q4_1, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q5_0(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q5_0, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q5_1(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q5_1, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q2_0(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q2_0, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q2_0_128(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q2_0_128, blocks.product_unsigned, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q8_0(weights, values, scales, sums, out):
    return matmul_int8(blocks.decode_q8_0, blocks.product_signed, weights, values, scales, sums, out)


@njit(nogil=True, cache=True)
def matmul_q4_k(weights, values, scales, sums, out):
    return matmul_super(blocks.scales_q4_k, blocks.unit_q4_k, blocks.product_unsigned, weights, values, scales, sums,
                        out)


@njit(nogil=True, cache=True)
def matmul_q5_k(weights, values, scales, sums, out):
    return matmul_super(blocks.scales_q5_k, blocks.unit_q5_k, blocks.product_unsigned, weights, values, scales, sums,
                        out)


@njit(nogil=True, cache=True)
def matmul_q6_k(weights, values, scales, sums, out):
    return matmul_super(blocks.scales_q6_k, blocks.unit_q6_k, blocks.product_offset32, weights, values, scales, sums,
                        out)
