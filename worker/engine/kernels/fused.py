"""The steps of a pre-norm block, each one compiled call: norm, products, RoPE, SwiGLU, residual.

A decode step of a small model spends as long between kernels as in them when every step of a
block is its own Python call (25 calls of 5-20 µs per layer); here a block is four calls:
``attention_inputs`` (RMSNorm, int8 rounding, Q/K/V products and biases, per-head Q/K norms,
RoPE), the attention of each sequence over its cache (``attention.store_and_attend``),
``attention_output`` (output projection, residual) and ``swiglu`` (RMSNorm, gate/up, SiLU, down,
residual), and one sequence's whole block is one call (``dense_block``). Each call that calls
others compiles them again into its own code (numba links its callees' code and optimizes the
whole): a first start pays for every level of nesting, so there are no more than these.

Weights are passed as the arrays their kernels take (``weights.Weight.kernel_array``); every
product goes to the kernel of the array's type (``product``). Rows stay independent
throughout, so a stream's numbers do not depend on the batch around it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from worker.engine.kernels import attention, gemm, matmul, rowwise
from worker.engine.kernels.activations import quantized
from worker.engine.kernels.attention import exp_nonpositive, exp_nonpositive8
from worker.engine.kernels.simd import (abs_f32, add_f32, div_f32, load_f32x8, mul_f32, splat_f32, store_f32x8, sub_f32,
                                        where_nonnegative_f32, zeros_f32)

def product(weights, x, acts, out):
    """out [m, n_out] = x Wᵀ by the kernel of W's type, which the numba type of its array names:
    the record of its panel blocks (``panels.block_dtype``), float32, or the record of a 2-byte
    float (``weights.FLOAT_RECORDS``). Only the kernels of the types a file holds compile.
    acts: x's int8 form (values, scales, sums, isums, hsums)."""


@overload(product, jit_options={"nogil": True})
def _product(weights, x, acts, out):
    dtype = weights.dtype
    if isinstance(dtype, types.Record):
        name = next(iter(dtype.fields))
        if name in FLOAT_KINDS:
            kind = FLOAT_KINDS[name]
            return lambda weights, x, acts, out: matmul.matmul_float(kind, weights, x, out)
        kernel = getattr(gemm, f"gemm_{name}")
        return lambda weights, x, acts, out: kernel(weights, acts[0], acts[1], acts[2], acts[3], acts[4], out)
    if dtype == types.float32:
        return lambda weights, x, acts, out: matmul.matmul_float(matmul.F32, weights, x, out)
    raise TypeError(f"no product for weights of {dtype}")


FLOAT_KINDS = {"f16": matmul.F16, "bf16": matmul.BF16}


@njit(nogil=True, cache=True)
def _add_bias(y, bias):
    if bias.shape[0]:
        for r in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[r, j] += bias[j]


@njit(nogil=True, cache=True)
def attention_inputs(x, norm, eps, wq, wk, wv, bq, bk, bv, q_norm, k_norm, cos, sin, adjacent,
                     n_head, n_kv, head_dim, value_dim):
    """h = RMSNorm(x) · norm; q, k, v = h Wqᵀ + bq, h Wkᵀ + bk, h Wvᵀ + bv (a bias of size 0 is
    none), per-head RMSNorm of q and k where q_norm / k_norm are given, RoPE on q and k
    (``rowwise.rope``). Returns q [T, H, d], k [T, K, d], v [T, K, dv]."""
    m = x.shape[0]
    h = rowwise.rms_norm(x, norm, eps, np.empty_like(x))
    acts = quantized(h)
    q = np.empty((m, n_head * head_dim), dtype=np.float32)
    k = np.empty((m, n_kv * head_dim), dtype=np.float32)
    v = np.empty((m, n_kv * value_dim), dtype=np.float32)
    product(wq, h, acts, q)
    product(wk, h, acts, k)
    product(wv, h, acts, v)
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
def attention_output(x, attn, wo):
    """x += attn Woᵀ (in place)."""
    y = product(wo, attn, quantized(attn), np.empty(x.shape, dtype=np.float32))
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
def swiglu(x, norm, eps, wg, wu, wd, n_ff):
    """x += down(silu(h Wgᵀ) · h Wuᵀ) with h = RMSNorm(x) · norm (in place)."""
    m = x.shape[0]
    h = rowwise.rms_norm(x, norm, eps, np.empty_like(x))
    acts = quantized(h)
    g = np.empty((m, n_ff), dtype=np.float32)
    u = np.empty((m, n_ff), dtype=np.float32)
    product(wg, h, acts, g)
    product(wu, h, acts, u)
    t = silu_times(g, u)
    y = product(wd, t, quantized(t), np.empty(x.shape, dtype=np.float32))
    x += y
    return x


@njit(nogil=True, cache=True)
def dense_block(x, attention_spec, rope, keys, values, first_pos, scale, window, softcap, tiled, tasks, output_spec,
                swiglu_spec):
    """A whole pre-norm block of one sequence in one call: ``attention_inputs``, the cache write
    and attention (``attention.store_and_attend``), ``attention_output``, ``swiglu``. The specs are
    those functions' argument tuples (``model.FusedLayer``); rope: (cos, sin, adjacent, n_head,
    n_kv, head_dim, value_dim). A decode step of a small model pays for each call from Python
    about as much as for a layer's norms and rounding."""
    n_head, value_dim = rope[3], rope[6]
    q, k, v = attention_inputs(x, *attention_spec, *rope)
    attn = np.empty((x.shape[0], n_head * value_dim), dtype=np.float32)
    attention.store_and_attend(q, k, v, keys, values, first_pos, scale, window, softcap, attn, tiled, tasks)
    attention_output(x, attn, *output_spec)
    return swiglu(x, *swiglu_spec)
