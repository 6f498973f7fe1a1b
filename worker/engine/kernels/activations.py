"""Activations quantized for the int8 dot products: per 32-value block, int8 values and a scale.

A row x [n] becomes q [n] int8 with q = round(x / d), d = max|x| / 127 per block of 32, plus
d [n/32], s = d * Σq [n/32] (the block's sum, which a weight type with a minimum needs) and
the integer sums Σq per block [n/32] and per 16 values [n/16] (which take a weight type's
centre off its levels, exactly). The rounding error per value is at most d/2, below 0.4% of the block's
largest magnitude; this is the same activation format GGML's CPU kernels use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels.simd import (abs_f32, add_f32, load_f32x8, max_f32, max_lane_f32, mul_f32, rint_f32,
                                        splat_f32, store_i8x8, sum_f32)

BLOCK = 32


@njit(inline="always", cache=True)
def _quantize_row(x, q, scales, sums, isums, hsums, r):
    """Row r, eight lanes at a time (the loop vectorizer leaves max and rounding scalar)."""
    row, levels = x[r], q[r]
    for b in range(x.shape[1] // BLOCK):
        start = b * BLOCK
        v0, v1 = load_f32x8(row, start), load_f32x8(row, start + 8)
        v2, v3 = load_f32x8(row, start + 16), load_f32x8(row, start + 24)
        largest = max_lane_f32(max_f32(max_f32(abs_f32(v0), abs_f32(v1)), max_f32(abs_f32(v2), abs_f32(v3))))
        inverse = splat_f32(np.float32(127.0) / largest if largest > 0 else np.float32(0.0))
        l0, l1 = rint_f32(mul_f32(v0, inverse)), rint_f32(mul_f32(v1, inverse))
        l2, l3 = rint_f32(mul_f32(v2, inverse)), rint_f32(mul_f32(v3, inverse))
        store_i8x8(levels, start, l0)
        store_i8x8(levels, start + 8, l1)
        store_i8x8(levels, start + 16, l2)
        store_i8x8(levels, start + 24, l3)
        scales[r, b] = largest / np.float32(127.0)
        # whole numbers below 2^12 in magnitude: the float sums are exact
        first, second = np.int32(sum_f32(add_f32(l0, l1))), np.int32(sum_f32(add_f32(l2, l3)))
        hsums[r, 2 * b] = first
        hsums[r, 2 * b + 1] = second
        isums[r, b] = first + second
        sums[r, b] = scales[r, b] * np.float32(first + second)


@njit(parallel=True, nogil=True, cache=True)
def _quantize_in_parallel(x, q, scales, sums, isums, hsums):
    for r in prange(x.shape[0]):
        _quantize_row(x, q, scales, sums, isums, hsums, r)


FEW_ROWS = 8  # fewer rows than this are quantized on the calling thread


@njit(nogil=True, cache=True)
def quantize_rows(x, q, scales, sums, isums, hsums):
    """x [m, n] float32 (contiguous, n % 32 == 0) -> q [m, n] int8, scales [m, n/32] and
    sums [m, n/32] float32, isums [m, n/32] and hsums [m, n/16] int32. A decode step's few rows
    stay on the calling thread: opening a parallel region would cost more than their work."""
    if x.shape[0] < FEW_ROWS:
        for r in range(x.shape[0]):
            _quantize_row(x, q, scales, sums, isums, hsums, r)
    else:
        _quantize_in_parallel(x, q, scales, sums, isums, hsums)


@njit(nogil=True, cache=True)
def quantized(x):
    """x [m, n] -> its int8 form (values, scales, sums, isums, hsums)."""
    m, n = x.shape
    values = np.empty((m, n), dtype=np.int8)
    scales = np.empty((m, n // BLOCK), dtype=np.float32)
    sums = np.empty((m, n // BLOCK), dtype=np.float32)
    isums = np.empty((m, n // BLOCK), dtype=np.int32)
    hsums = np.empty((m, 2 * (n // BLOCK)), dtype=np.int32)
    quantize_rows(x, values, scales, sums, isums, hsums)
    return values, scales, sums, isums, hsums


class QuantizedActivations:
    """The int8 form of a [m, n] float32 matrix, made once and shared by every weight it meets."""

    __slots__ = ("values", "scales", "sums", "isums", "hsums")

    def __init__(self, x: np.ndarray):
        m, n = x.shape
        if n % BLOCK:
            raise ValueError(f"rows of {n} values do not split into blocks of {BLOCK}")
        self.values, self.scales, self.sums, self.isums, self.hsums = quantized(
            np.ascontiguousarray(x, dtype=np.float32))

    @property
    def parts(self) -> tuple[np.ndarray, ...]:
        """(values, scales, sums, isums, hsums), as the kernels take them."""
        return self.values, self.scales, self.sums, self.isums, self.hsums
