"""Compiled row-wise steps of a block: RMSNorm and RoPE (half-split or adjacent pairs).

A decode step runs each of these on a few hundred values, where numpy's per-call cost (one
temporary and one pass per ufunc) would outweigh the work; one compiled pass does each.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def rms_norm(x, weight, eps, out):
    """out = x / sqrt(mean(x²) + eps) * weight per row; x, out [m, n], weight [n] or [0] (none).

    Not fast-math: the sum of squares adds left to right, so a row gets the same bits wherever
    it sits in memory (a vectorized sum's order depends on the row's alignment)."""
    m, n = x.shape
    for r in range(m):
        total = np.float32(0.0)
        for j in range(n):
            total += x[r, j] * x[r, j]
        scale = np.float32(1.0) / np.sqrt(total / n + np.float32(eps))
        if weight.shape[0]:
            for j in range(n):
                out[r, j] = x[r, j] * scale * weight[j]
        else:
            for j in range(n):
                out[r, j] = x[r, j] * scale
    return out


@njit(fastmath=True, nogil=True, cache=True)
def rope(x, cos, sin, adjacent, out):
    """Rotate each head's first n_rot dims by its position's angles: x, out [T, heads, d] (out
    may be x); cos, sin [T, n_rot/2]. Pair i is (i, i + n_rot/2) (half-split, NEOX), or
    (2i, 2i + 1) with ``adjacent`` (the form llama's GGUF rows are permuted for). Dimensions past
    n_rot are copied."""
    n_tokens, n_heads, head_dim = x.shape
    half = cos.shape[1]
    first, second = (2, 1) if adjacent else (1, half)  # pair i is (first * i, first * i + second)
    for t in range(n_tokens):
        for h in range(n_heads):
            for i in range(half):
                a = x[t, h, first * i]
                b = x[t, h, first * i + second]
                out[t, h, first * i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, first * i + second] = b * cos[t, i] + a * sin[t, i]
            for i in range(2 * half, head_dim):
                out[t, h, i] = x[t, h, i]
    return out
