"""Compiled row-wise steps of a block: RMSNorm, RoPE (half-split or adjacent pairs) and the
GELU-gated product of a gated FFN.

A decode step runs each of these on a few hundred values, where numpy's per-call cost (one
temporary and one pass per ufunc) would outweigh the work; one compiled pass does each. A
prefill chunk's GELU gate is a few hundred thousand values, for which numpy's nine passes over
memory cost more than the products around it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.kernels.attention import exp_nonpositive, exp_nonpositive8
from worker.engine.kernels.simd import (abs_f32, add_f32, div_f32, fmadd, load_f32x8, mul_f32, splat_f32,
                                        store_f32x8, sum_pairs_f32, where_nonnegative_f32, zeros_f32)

GELU_C = np.float32(np.sqrt(2.0 / np.pi))  # tanh-approximated GELU: tanh(C (g + 0.044715 g³))
GELU_C3 = np.float32(np.sqrt(2.0 / np.pi) * 0.044715)


@njit(nogil=True, cache=True)
def rms_norm(x, weight, eps, out):
    """out = x / sqrt(mean(x²) + eps) * weight per row; x, out [m, n], weight [n] or [0] (none).

    Not fast-math: the order of the sum of squares is fixed by index, so a row gets the same bits
    wherever it sits in memory (a compiler's vectorized sum would follow the row's alignment).
    Lane l of eight sums the squares of values l, l + 8, ... in turn, the lanes are added in one
    fixed tree, then the values past the last multiple of 8 in order."""
    m, n = x.shape
    head = n - n % 8
    for r in range(m):
        row = np.ascontiguousarray(x[r])  # the lanes load in place
        lanes = zeros_f32()
        for j in range(0, head, 8):
            v = load_f32x8(row, j)
            lanes = fmadd(v, v, lanes)
        total = sum_pairs_f32(lanes)
        for j in range(head, n):
            total += row[j] * row[j]
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


@njit(inline="always", cache=True)
def _gelu_tanh(g):
    """0.5 g (1 + tanh(y)) = g σ(2y), y = C (g + 0.044715 g³), with s = e^(-2|y|) (never
    overflowing): σ(2y) = 1 / (1 + s) for y >= 0, s / (1 + s) below."""
    y = g * (GELU_C + GELU_C3 * g * g)
    s = exp_nonpositive(np.float32(-2.0) * abs(y))
    return g * (np.float32(1.0) if y >= 0 else s) / (np.float32(1.0) + s)


@njit(nogil=True, cache=True)
def gelu_tanh_times(g, u, out):
    """out = GELU(g) · u (the tanh form, as ``ops.gelu_tanh``) for g, u, out [m, n] float32,
    C-ordered; out may be g. Eight values a step, every value the same operations wherever it
    sits (the tail by the same formula on one lane), so a row's bits do not depend on the others."""
    m, n = g.shape
    head = n - n % 8
    ones, c, c3, minus_two = splat_f32(1.0), splat_f32(GELU_C), splat_f32(GELU_C3), splat_f32(-2.0)
    for r in range(m):
        gate, up, result = g[r], u[r], out[r]
        for j in range(0, head, 8):
            x = load_f32x8(gate, j)
            y = mul_f32(x, fmadd(mul_f32(c3, x), x, c))
            s = exp_nonpositive8(mul_f32(minus_two, abs_f32(y)))
            sigma = div_f32(where_nonnegative_f32(y, ones, s), add_f32(ones, s))
            store_f32x8(result, j, mul_f32(mul_f32(x, sigma), load_f32x8(up, j)))
        for j in range(head, n):
            result[j] = _gelu_tanh(gate[j]) * up[j]
    return out
