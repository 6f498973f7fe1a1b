"""How each GGML block type turns 32 weights into bytes an int8 dot product can take.

Every type here is read in units of 32 consecutive weights of a row: unit ``u`` covers columns
``32u .. 32u+31``, the same span as one block of the quantized activations (see
``activations.py``). ``decode_<type>(row, u)`` returns

    (q, pair_scales, scale, offset)

(the K-quants split this in two, see below) so that the unit's dot product with an activation
block (int8 values ``a``, scale ``d_a``, and ``s_a = d_a * sum(a)``) is

    scale * d_a * Σ_halves pair_scales_h * Σ q_i a_i  +  offset * s_a

``q`` holds unsigned bytes (the weight's integer level), ``pair_scales`` the int16 factor of
each 16-weight half (ones unless a type scales halves separately), ``scale`` and ``offset``
the float factors (float32: a float64 factor would put conversions in the inner loop).
``product_<kind>`` computes the integer part. Layouts follow GGML's block
structs (the ``gguf`` package's dequantizers are the reference the tests compare against).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from worker.engine.kernels.simd import (abs_bytes, bits_as_bytes, bytes_f32, dot_bytes, load_f16, load_i8x8_crumbs,
                                        load_i8x16_nibbles, load_i8x32, load_u32, low_nibbles, mul_f32, or_bytes,
                                        pair_scales_i16,
                                        shifted_bits, sign_bytes, splat_f32, splat_i16, splat_i8, sub_bytes, where_bits,
                                        zeros_f32)

_inline = dict(inline="always", cache=True)


# --- integer products of one unit --------------------------------------------------------------

@njit(**_inline)
def product_unsigned(q, pair_scales, a):
    """Σ q·a per 8 lanes, each 16-weight half times its scale (q in 0..63, a int8)."""
    return dot_bytes(q, a, pair_scales)


@njit(**_inline)
def product_signed(q, pair_scales, a):
    """The same for signed weights: |q| × (a with q's sign) keeps the left side unsigned."""
    return dot_bytes(abs_bytes(q), sign_bytes(a, q), pair_scales)


@njit(**_inline)
def product_offset32(q, pair_scales, a):
    """Σ (q - 32)·a per half, times the half's scale (Q6_K's levels are centred on 32)."""
    return product_signed(sub_bytes(q, splat_i8(32)), pair_scales, a)


# --- 32-weight blocks -----------------------------------------------------------------------------

@njit(**_inline)
def decode_q4_0(row, u):
    # 18 bytes: scale (f16), 16 bytes of nibbles; weight = d * (q - 8)
    base = u * 18
    d = load_f16(row, base)
    return load_i8x16_nibbles(row, base + 2), splat_i16(1), d, np.float32(-8.0) * d


@njit(**_inline)
def decode_q4_1(row, u):
    # 20 bytes: scale and minimum (f16), 16 bytes of nibbles; weight = d * q + m
    base = u * 20
    return load_i8x16_nibbles(row, base + 4), splat_i16(1), load_f16(row, base), load_f16(row, base + 2)


@njit(**_inline)
def decode_q5_0(row, u):
    # 22 bytes: scale (f16), 32 fifth bits (bit j: weight j), 16 bytes of nibbles as in Q4_0;
    # weight = d * (q - 16)
    base = u * 22
    d = load_f16(row, base)
    q = or_bytes(load_i8x16_nibbles(row, base + 6), bits_as_bytes(load_u32(row, base + 2), 16))
    return q, splat_i16(1), d, np.float32(-16.0) * d


@njit(**_inline)
def decode_q5_1(row, u):
    # 24 bytes: scale and minimum (f16), 32 fifth bits, 16 bytes of nibbles; weight = d * q + m
    base = u * 24
    q = or_bytes(load_i8x16_nibbles(row, base + 8), bits_as_bytes(load_u32(row, base + 4), 16))
    return q, splat_i16(1), load_f16(row, base), load_f16(row, base + 2)


@njit(**_inline)
def decode_q8_0(row, u):
    # 34 bytes: scale (f16), 32 signed bytes; weight = d * q
    base = u * 34
    return load_i8x32(row, base + 2), splat_i16(1), load_f16(row, base), types.float32(0.0)


@njit(**_inline)
def decode_q2_0(row, u):
    # ggml's Q2_0: 18 bytes per 64 weights, scale (f16) and 16 bytes of 2-bit codes, unit u the
    # first or second 8 of them; weight = d * (code - 1)
    base = (u >> 1) * 18
    d = load_f16(row, base)
    return load_i8x8_crumbs(row, base + 2 + (u & 1) * 8), splat_i16(1), d, -d


@njit(**_inline)
def decode_q2_0_128(row, u):
    # PrismML's Q2_0: 34 bytes per 128 weights, scale and 32 bytes of codes, unit u a quarter
    base = (u >> 2) * 34
    d = load_f16(row, base)
    return load_i8x8_crumbs(row, base + 2 + (u & 3) * 8), splat_i16(1), d, -d


# --- 256-weight super-blocks (K-quants): eight units each -----------------------------------------
#
# A super-block's factors are decoded once for its eight units: ``scales_<type>(row, s)`` gives
# the eight units' float scales and offsets as two 8-lane vectors (lane j: unit j), and
# ``unit_<type>(row, s, j)`` the bytes and half scales of unit j (j a constant where called).

_LOW6, _LOW4, _TOP2 = np.uint64(0x3F3F3F3F), np.uint64(0x0F0F0F0F), np.uint64(0x03030303)
_SHIFT4, _SHIFT6, _SHIFT32 = np.uint64(4), np.uint64(6), np.uint64(32)


@njit(**_inline)
def _k_scales(row, base):
    """d·scale_j and -dmin·min_j of a Q4_K / Q5_K super-block (d, dmin f16 at ``base``, then 12
    bytes packing eight 6-bit scales and mins: sub-blocks 0-3 in the low six bits of bytes 0-3
    (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11, their top two bits in
    the top bits of bytes 0-3 and 4-7)."""
    w0, w1, w2 = load_u32(row, base + 4), load_u32(row, base + 8), load_u32(row, base + 12)
    scales = (w0 & _LOW6) | (((w2 & _LOW4) | (((w0 >> _SHIFT6) & _TOP2) << _SHIFT4)) << _SHIFT32)
    mins = (w1 & _LOW6) | ((((w2 >> _SHIFT4) & _LOW4) | (((w1 >> _SHIFT6) & _TOP2) << _SHIFT4)) << _SHIFT32)
    return (mul_f32(splat_f32(load_f16(row, base)), bytes_f32(scales)),
            mul_f32(splat_f32(-load_f16(row, base + 2)), bytes_f32(mins)))


@njit(**_inline)
def _k_nibbles(row, nibbles_at, j):
    """Sub-block j's 32 four-bit levels: each 32 bytes of nibbles hold two sub-blocks, the low
    nibbles the first, the high nibbles the second."""
    packed = load_i8x32(row, nibbles_at + (j >> 1) * 32)
    return low_nibbles(packed) if j & 1 == 0 else shifted_bits(packed, 4, 0x0F)


@njit(**_inline)
def scales_q4_k(row, s):
    # 144 bytes: d, dmin (f16), 12 bytes of scales/mins, 128 bytes of nibbles
    return _k_scales(row, s * 144)


@njit(**_inline)
def unit_q4_k(row, s, j):
    return _k_nibbles(row, s * 144 + 16, j), splat_i16(1)


@njit(**_inline)
def scales_q5_k(row, s):
    # 176 bytes: d, dmin, 12 bytes of scales/mins, 32 bytes of fifth bits (bit j of byte l is
    # weight l of sub-block j), then nibbles laid out as in Q4_K
    return _k_scales(row, s * 176)


@njit(**_inline)
def unit_q5_k(row, s, j):
    base = s * 176
    return or_bytes(_k_nibbles(row, base + 48, j), where_bits(load_i8x32(row, base + 16), 1 << j, 16)), splat_i16(1)


@njit(**_inline)
def scales_q6_k(row, s):
    # 210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per
    # 16 weights, see unit_q6_k), d (f16). Weight = d * scale * (q - 32).
    return splat_f32(load_f16(row, s * 210 + 208)), zeros_f32()


@njit(**_inline)
def unit_q6_k(row, s, j):
    # Each half of 128 weights is four groups of 32: groups 0 and 1 take the low nibbles of
    # ql[0:32] and ql[32:64], groups 2 and 3 their high nibbles; group k's high bits are bits
    # 2k, 2k+1 of qh[0:32].
    base = s * 210
    half = j >> 2
    group = j & 3
    ql = load_i8x32(row, base + half * 64 + (group & 1) * 32)
    low = low_nibbles(ql) if group < 2 else shifted_bits(ql, 4, 0x0F)
    high = shifted_bits(load_i8x32(row, base + 128 + half * 32), 2 * group - 4, 0x30)
    scales_at = base + 192 + half * 8 + group * 2
    return or_bytes(low, high), pair_scales_i16(_signed_byte(row[scales_at]), _signed_byte(row[scales_at + 1]))


@njit(**_inline)
def _signed_byte(value):
    return value - 256 if value >= 128 else value
