"""The steps of a pre-norm block, each one compiled call: norm, products, RoPE, SwiGLU, residual.

A decode step of a small model spends as long between kernels as in them when every step of a
block is its own Python call (25 calls of 5-20 µs per layer); here a block is three calls:
``attention_inputs`` (RMSNorm, int8 rounding, Q/K/V products and biases, per-head Q/K norms,
RoPE), the attention of each sequence over its cache (``attention.store_and_attend``), and
``attention_output_swiglu`` (output projection, residual, RMSNorm, gate/up, SiLU, down,
residual), or ``attention_output`` where the feed-forward half is not a SwiGLU.

Weights are passed as their GGUF bytes [n_out, row bytes] with their GGML type code; every
product goes to the kernel of that type (``product``). Rows stay independent throughout, so a
stream's numbers do not depend on the batch around it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from worker.engine.kernels import attention, matmul, rowwise
from worker.engine.kernels.activations import BLOCK, quantize_rows
from worker.engine.kernels.attention import exp_nonpositive, exp_nonpositive8
from worker.engine.kernels.simd import (abs_f32, add_f32, div_f32, load_f32x8, mul_f32, splat_f32, store_f32x8, sub_f32,
                                        where_nonnegative_f32, zeros_f32)

# GGML type codes of the types with a kernel (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
TYPE_CODES = frozenset((F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16))


@njit(nogil=True, cache=True)
def quantized(x):
    """x [m, n] -> its int8 form (values, scales, sums) for the integer kernels."""
    m, n = x.shape
    values = np.empty((m, n), dtype=np.int8)
    scales = np.empty((m, n // BLOCK), dtype=np.float32)
    sums = np.empty((m, n // BLOCK), dtype=np.float32)
    quantize_rows(x, values, scales, sums)
    return values, scales, sums


@njit(nogil=True, cache=True)
def product(kind, weights, x, values, scales, sums, out):
    """out [m, n_out] = x Wᵀ for W of GGML type ``kind``; (values, scales, sums) is x's int8 form."""
    if kind == Q4_0:
        matmul.matmul_q4_0(weights, values, scales, sums, out)
    elif kind == Q4_1:
        matmul.matmul_q4_1(weights, values, scales, sums, out)
    elif kind == Q5_0:
        matmul.matmul_q5_0(weights, values, scales, sums, out)
    elif kind == Q5_1:
        matmul.matmul_q5_1(weights, values, scales, sums, out)
    elif kind == Q8_0:
        matmul.matmul_q8_0(weights, values, scales, sums, out)
    elif kind == Q4_K:
        matmul.matmul_q4_k(weights, values, scales, sums, out)
    elif kind == Q5_K:
        matmul.matmul_q5_k(weights, values, scales, sums, out)
    elif kind == Q6_K:
        matmul.matmul_q6_k(weights, values, scales, sums, out)
    elif kind == F32:
        matmul.matmul_float(matmul.F32, weights, x, out)
    elif kind == F16:
        matmul.matmul_float(matmul.F16, weights, x, out)
    else:
        matmul.matmul_float(matmul.BF16, weights, x, out)
    return out


@njit(nogil=True, cache=True)
def _add_bias(y, bias):
    if bias.shape[0]:
        for r in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[r, j] += bias[j]


@njit(nogil=True, cache=True)
def attention_inputs(x, norm, eps, wq, wk, wv, kinds, bq, bk, bv, q_norm, k_norm, cos, sin, adjacent,
                     n_head, n_kv, head_dim, value_dim):
    """h = RMSNorm(x) · norm; q, k, v = h Wqᵀ + bq, h Wkᵀ + bk, h Wvᵀ + bv (a bias of size 0 is
    none), per-head RMSNorm of q and k where q_norm / k_norm are given, RoPE on q and k
    (``rowwise.rope``). kinds: the GGML types of wq, wk, wv. Returns q [T, H, d], k [T, K, d],
    v [T, K, dv]."""
    m = x.shape[0]
    h = rowwise.rms_norm(x, norm, eps, np.empty_like(x))
    values, scales, sums = quantized(h)
    q = np.empty((m, n_head * head_dim), dtype=np.float32)
    k = np.empty((m, n_kv * head_dim), dtype=np.float32)
    v = np.empty((m, n_kv * value_dim), dtype=np.float32)
    product(kinds[0], wq, h, values, scales, sums, q)
    product(kinds[1], wk, h, values, scales, sums, k)
    product(kinds[2], wv, h, values, scales, sums, v)
    _add_bias(q, bq)
    _add_bias(k, bk)
    _add_bias(v, bv)
    if q_norm.shape[0]:
        heads = q.reshape((m * n_head, head_dim))
        rowwise.rms_norm(heads, q_norm, eps, heads)
    if k_norm.shape[0]:
        heads = k.reshape((m * n_kv, head_dim))
        rowwise.rms_norm(heads, k_norm, eps, heads)
    q3 = q.reshape((m, n_head, head_dim))
    k3 = k.reshape((m, n_kv, head_dim))
    rowwise.rope(q3, cos, sin, adjacent, q3)
    rowwise.rope(k3, cos, sin, adjacent, k3)
    return q3, k3, v.reshape((m, n_kv, value_dim))


@njit(nogil=True, cache=True)
def attention_output(x, attn, wo, kind):
    """x += attn Woᵀ (in place)."""
    values, scales, sums = quantized(attn)
    y = product(kind, wo, attn, values, scales, sums, np.empty(x.shape, dtype=np.float32))
    x += y
    return x


@njit(inline="always", fastmath=True, cache=True)
def _silu(a):
    """silu(a) = a / (1 + e^-a), written through e^-|a| so the exponential never overflows."""
    e = exp_nonpositive(-abs(a))
    s = a / (np.float32(1.0) + e)
    return s if a >= 0 else s * e


@njit(nogil=True, cache=True)
def silu_times(g, u):
    """silu(g) · u in place in g, eight lanes at a time (the loop vectorizer would leave the
    exponential's max and floor scalar)."""
    n = g.shape[1]
    one = splat_f32(1.0)
    for r in range(g.shape[0]):
        gr, ur = g[r], u[r]
        j = 0
        while j + 8 <= n:
            a = load_f32x8(gr, j)
            e = exp_nonpositive8(sub_f32(zeros_f32(), abs_f32(a)))
            s = div_f32(a, add_f32(one, e))
            store_f32x8(gr, j, mul_f32(where_nonnegative_f32(a, s, mul_f32(s, e)), load_f32x8(ur, j)))
            j += 8
        while j < n:
            gr[j] = _silu(gr[j]) * ur[j]
            j += 1
    return g


@njit(nogil=True, cache=True)
def swiglu(x, norm, eps, wg, wu, wd, kinds, n_ff):
    """x += down(silu(h Wgᵀ) · h Wuᵀ) with h = RMSNorm(x) · norm (in place). kinds: the GGML
    types of wg, wu, wd."""
    m = x.shape[0]
    h = rowwise.rms_norm(x, norm, eps, np.empty_like(x))
    values, scales, sums = quantized(h)
    g = np.empty((m, n_ff), dtype=np.float32)
    u = np.empty((m, n_ff), dtype=np.float32)
    product(kinds[0], wg, h, values, scales, sums, g)
    product(kinds[1], wu, h, values, scales, sums, u)
    t = silu_times(g, u)
    values, scales, sums = quantized(t)
    y = product(kinds[2], wd, t, values, scales, sums, np.empty(x.shape, dtype=np.float32))
    x += y
    return x


@njit(nogil=True, cache=True)
def attention_output_swiglu(x, attn, wo, kind_o, norm, eps, wg, wu, wd, kinds, n_ff):
    """``attention_output`` then ``swiglu``: the second half of a dense block in one call."""
    attention_output(x, attn, wo, kind_o)
    return swiglu(x, norm, eps, wg, wu, wd, kinds, n_ff)


@njit(nogil=True, cache=True)
def dense_block(x, attention_spec, rope, keys, values, first_pos, scale, window, softcap, output_spec,
                swiglu_spec):
    """A whole pre-norm block of one sequence in one call: ``attention_inputs``, the cache write
    and attention (``attention.store_and_attend``), ``attention_output_swiglu``. The specs are
    those functions' argument tuples (``model.FusedLayer``); rope: (cos, sin, adjacent, n_head,
    n_kv, head_dim, value_dim). A decode step of a small model pays for each call from Python
    about as much as for a layer's norms and rounding."""
    n_head, value_dim = rope[3], rope[6]
    q, k, v = attention_inputs(x, *attention_spec, *rope)
    attn = np.empty((x.shape[0], n_head * value_dim), dtype=np.float32)
    attention.store_and_attend(q, k, v, keys, values, first_pos, scale, window, softcap, attn)
    return attention_output_swiglu(x, attn, *output_spec, *swiglu_spec)
