"""Compiled row-wise steps of a block: RMSNorm and half-split RoPE.

A decode step runs each of these on a few hundred values, where numpy's per-call cost (one
temporary and one pass per ufunc) would outweigh the work; one compiled pass does each.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
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


@njit(fastmath=True, cache=True)
def rope_halves(x, cos, sin, out):
    """Rotate pairs (i, i + n_rot/2) of each head: x, out [T, heads, d]; cos, sin [T, n_rot/2].
    Dimensions past n_rot are copied."""
    n_tokens, n_heads, head_dim = x.shape
    half = cos.shape[1]
    for t in range(n_tokens):
        for h in range(n_heads):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i + half] = b * cos[t, i] + a * sin[t, i]
            for i in range(2 * half, head_dim):
                out[t, h, i] = x[t, h, i]
    return out
