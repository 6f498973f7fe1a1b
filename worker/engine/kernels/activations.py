"""Activations quantized for the int8 dot products: per 32-value block, int8 values and a scale.

A row x [n] becomes q [n] int8 with q = round(x / d), d = max|x| / 127 per block of 32, plus
d [n/32] and s = d * Σq [n/32] (the block's sum, which a weight type with an offset or a
minimum needs). The rounding error per value is at most d/2, below 0.4% of the block's
largest magnitude; this is the same activation format GGML's CPU kernels use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

BLOCK = 32


@njit(parallel=True, fastmath=True, cache=True)
def quantize_rows(x, q, scales, sums):
    """x [m, n] float32 -> q [m, n] int8, scales [m, n/32], sums [m, n/32] (float32)."""
    m, n = x.shape
    for r in prange(m):
        for b in range(n // BLOCK):
            start = b * BLOCK
            largest = np.float32(0.0)
            for j in range(start, start + BLOCK):
                largest = max(largest, abs(x[r, j]))
            inverse = np.float32(127.0) / largest if largest > 0 else np.float32(0.0)
            total = 0
            for j in range(start, start + BLOCK):
                level = np.int32(np.rint(x[r, j] * inverse))
                q[r, j] = level
                total += level
            scales[r, b] = largest / np.float32(127.0)
            sums[r, b] = scales[r, b] * total


class QuantizedActivations:
    """The int8 form of a [m, n] float32 matrix, made once and shared by every weight it meets."""

    __slots__ = ("values", "scales", "sums")

    def __init__(self, x: np.ndarray):
        m, n = x.shape
        if n % BLOCK:
            raise ValueError(f"rows of {n} values do not split into blocks of {BLOCK}")
        self.values = np.empty((m, n), dtype=np.int8)
        self.scales = np.empty((m, n // BLOCK), dtype=np.float32)
        self.sums = np.empty((m, n // BLOCK), dtype=np.float32)
        quantize_rows(np.ascontiguousarray(x, dtype=np.float32), self.values, self.scales, self.sums)
