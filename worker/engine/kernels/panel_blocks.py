"""How a panel block of each type (``panels.py``) turns into what the GEMM's rows meet.

``unit_<type>(w, at, u)`` decodes unit u (32 weights of every output of the panel whose first
byte is ``at``) into eight group vectors (``wide_simd.py``) and the unit's factors as float
lanes; ``row_*(unit, values, scales, sums, isums, hsums, r, u, acc, low)`` adds activation row
r's share to that row's running sums, in the order ``gemm.py`` states: the unit's exact integer
product (the type's centre taken off), then one fused multiply-add by the scales, and for types
with a minimum one more for the offset.
"""

from __future__ import annotations

from numba import njit

from worker.engine.kernels import tiles
from worker.engine.kernels.wide_simd import (LANES, PANEL, SIGNED_OFFSET, add_int, bits_of_bytes,
                                               dot_prepared_signed, dot_unsigned, field, fma_float, fma_splat,
                                               load_bytes, load_halves, load_signed_bytes, load_words, minus_splat,
                                               mul_float, mul_int, or_bytes, or_int, prepare_signed, shifted_left,
                                               shifted_up, splat_quad, times_splat, to_floats,
                                               with_bit_set, zeros_int)

P, L = PANEL, LANES

_inline = dict(inline="always", cache=True)


# --- integer products of one unit with one row ------------------------------------------------------

@njit(**_inline)
def _dots(gs, a, k):
    """Σ level · a over a unit's eight groups (activation bytes k.. of row a), two chains."""
    even = dot_unsigned(zeros_int(), gs[0], splat_quad(a, k))
    odd = dot_unsigned(zeros_int(), gs[1], splat_quad(a, k + 4))
    even = dot_unsigned(even, gs[2], splat_quad(a, k + 8))
    odd = dot_unsigned(odd, gs[3], splat_quad(a, k + 12))
    even = dot_unsigned(even, gs[4], splat_quad(a, k + 16))
    odd = dot_unsigned(odd, gs[5], splat_quad(a, k + 20))
    even = dot_unsigned(even, gs[6], splat_quad(a, k + 24))
    odd = dot_unsigned(odd, gs[7], splat_quad(a, k + 28))
    return add_int(even, odd)


@njit(**_inline)
def _dots_signed(gs, a, k):
    even = dot_prepared_signed(zeros_int(), gs[0], splat_quad(a, k))
    odd = dot_prepared_signed(zeros_int(), gs[1], splat_quad(a, k + 4))
    even = dot_prepared_signed(even, gs[2], splat_quad(a, k + 8))
    odd = dot_prepared_signed(odd, gs[3], splat_quad(a, k + 12))
    even = dot_prepared_signed(even, gs[4], splat_quad(a, k + 16))
    odd = dot_prepared_signed(odd, gs[5], splat_quad(a, k + 20))
    even = dot_prepared_signed(even, gs[6], splat_quad(a, k + 24))
    odd = dot_prepared_signed(odd, gs[7], splat_quad(a, k + 28))
    return add_int(even, odd)


@njit(**_inline)
def _half_dots(gs, a, k, first):
    """Σ level · a over groups first..first+3 (16 weights)."""
    p = dot_unsigned(zeros_int(), gs[first], splat_quad(a, k))
    q = dot_unsigned(zeros_int(), gs[first + 1], splat_quad(a, k + 4))
    p = dot_unsigned(p, gs[first + 2], splat_quad(a, k + 8))
    q = dot_unsigned(q, gs[first + 3], splat_quad(a, k + 12))
    return add_int(p, q)


# --- how each row meets a decoded unit -----------------------------------------------------------
# row(unit, values, scales, sums, isums, hsums, r, u, acc, low) -> acc, low: the unit's integer
# products with row r by the vector unit, then ``finish``;
# finish(unit, ints, scales, sums, isums, hsums, r, u, acc, low) -> acc, low: the float steps
# from the row's integer products ``ints`` (Σ level · a over the unit, and where a type scales
# each 16 weights, over its second half too), which the tile unit gives as well (``tiles_*``)

@njit(**_inline)
def _scaled(dw, da, integer, acc):
    return fma_float(times_splat(dw, da), to_floats(integer), acc)


@njit(**_inline)
def _both(integer):
    return integer, integer


@njit(**_inline)
def finish_centred_8(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    return _scaled(unit[1], scales[r, u], minus_splat(ints[0], 8 * isums[r, u]), acc), low


@njit(**_inline)
def row_centred_8(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    return finish_centred_8(unit, _both(_dots(unit[0], values[r], 32 * u)), scales, sums, isums, hsums, r, u, acc, low)


@njit(**_inline)
def finish_centred_16(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    return _scaled(unit[1], scales[r, u], minus_splat(ints[0], 16 * isums[r, u]), acc), low


@njit(**_inline)
def row_centred_16(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    return finish_centred_16(unit, _both(_dots(unit[0], values[r], 32 * u)), scales, sums, isums, hsums, r, u, acc,
                             low)


@njit(**_inline)
def finish_centred_1(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    return _scaled(unit[1], scales[r, u], minus_splat(ints[0], isums[r, u]), acc), low


@njit(**_inline)
def row_centred_1(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    return finish_centred_1(unit, _both(_dots(unit[0], values[r], 32 * u)), scales, sums, isums, hsums, r, u, acc, low)


@njit(**_inline)
def finish_signed(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    """ints: Σ q · a with the signed weights themselves."""
    return _scaled(unit[1], scales[r, u], ints[0], acc), low


@njit(**_inline)
def row_signed(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    integer = _dots_signed(unit[0], values[r], 32 * u)
    if SIGNED_OFFSET:
        integer = minus_splat(integer, SIGNED_OFFSET * isums[r, u])
    return finish_signed(unit, _both(integer), scales, sums, isums, hsums, r, u, acc, low)


@njit(**_inline)
def finish_with_minimum(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    return _scaled(unit[1], scales[r, u], ints[0], acc), fma_splat(unit[2], sums[r, u], low)


@njit(**_inline)
def row_with_minimum(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    return finish_with_minimum(unit, _both(_dots(unit[0], values[r], 32 * u)), scales, sums, isums, hsums, r, u, acc,
                               low)


@njit(**_inline)
def finish_half_scaled(unit, ints, scales, sums, isums, hsums, r, u, acc, low):
    """Q6_K: each 16 weights have their own integer scale; levels are centred on 32."""
    gs, d, scale0, scale1 = unit
    first = minus_splat(ints[0], 32 * hsums[r, 2 * u])
    second = minus_splat(ints[1], 32 * hsums[r, 2 * u + 1])
    return _scaled(d, scales[r, u], add_int(mul_int(scale0, first), mul_int(scale1, second)), acc), low


@njit(**_inline)
def row_half_scaled(unit, values, scales, sums, isums, hsums, r, u, acc, low):
    a = values[r]
    ints = _half_dots(unit[0], a, 32 * u, 0), _half_dots(unit[0], a, 32 * u + 16, 4)
    return finish_half_scaled(unit, ints, scales, sums, isums, hsums, r, u, acc, low)


# --- the tile unit's products of a unit with 16 rows (Q8_0) -------------------------------------
# tiles(w, at, u, values, r, products, c): the integer products of rows r..r+15 with unit u, 16
# int32 a row, row r + i from byte c + 64·i of ``products``

@njit(**_inline)
def tiles_q8_0(w, at, u, values, r, products, c):
    # the panel's own signed bytes, where ``unit_q8_0`` finds them
    n = values.shape[1]
    tiles.product_signed(values, r * n + 32 * u, n, w, at + u * 34 * P + 2 * P, products, c)


# --- decoding one unit of a panel --------------------------------------------------------------
# unit(w, at, u) -> what the type's row function takes; ``at`` is the panel's first byte

@njit(**_inline)
def _nibble_groups(w, at):
    """Four LANES-byte vectors of nibbles -> eight group vectors (low nibbles: even groups)."""
    v0, v1, v2, v3 = load_bytes(w, at), load_bytes(w, at + L), load_bytes(w, at + 2 * L), load_bytes(w, at + 3 * L)
    return (bits_of_bytes(v0, 0, 0x0F), bits_of_bytes(v0, 4, 0x0F), bits_of_bytes(v1, 0, 0x0F),
            bits_of_bytes(v1, 4, 0x0F), bits_of_bytes(v2, 0, 0x0F), bits_of_bytes(v2, 4, 0x0F),
            bits_of_bytes(v3, 0, 0x0F), bits_of_bytes(v3, 4, 0x0F))


@njit(**_inline)
def _with_fifth_bits(gs, w, at):
    """Each group with 16 added where its LANES-bit mask (one per group from ``at``) is set."""
    step = L // 8
    return (with_bit_set(gs[0], w, at, 16), with_bit_set(gs[1], w, at + step, 16),
            with_bit_set(gs[2], w, at + 2 * step, 16), with_bit_set(gs[3], w, at + 3 * step, 16),
            with_bit_set(gs[4], w, at + 4 * step, 16), with_bit_set(gs[5], w, at + 5 * step, 16),
            with_bit_set(gs[6], w, at + 6 * step, 16), with_bit_set(gs[7], w, at + 7 * step, 16))


@njit(**_inline)
def _crumb_groups(w, at):
    """Two LANES-byte vectors of 2-bit codes -> eight group vectors (bits 2k of vector c: group 4c + k)."""
    c0, c1 = load_bytes(w, at), load_bytes(w, at + L)
    return (bits_of_bytes(c0, 0, 3), bits_of_bytes(c0, 2, 3), bits_of_bytes(c0, 4, 3), bits_of_bytes(c0, 6, 3),
            bits_of_bytes(c1, 0, 3), bits_of_bytes(c1, 2, 3), bits_of_bytes(c1, 4, 3), bits_of_bytes(c1, 6, 3))


@njit(**_inline)
def unit_q8_0(w, at, u):
    # per unit: d (P halves), eight group vectors of signed bytes
    b = at + u * 34 * P
    g = b + 2 * P
    gs = (prepare_signed(load_bytes(w, g)), prepare_signed(load_bytes(w, g + L)),
          prepare_signed(load_bytes(w, g + 2 * L)), prepare_signed(load_bytes(w, g + 3 * L)),
          prepare_signed(load_bytes(w, g + 4 * L)), prepare_signed(load_bytes(w, g + 5 * L)),
          prepare_signed(load_bytes(w, g + 6 * L)), prepare_signed(load_bytes(w, g + 7 * L)))
    return gs, load_halves(w, b)


@njit(**_inline)
def unit_q4_0(w, at, u):
    # d, nibbles; weight = d (q - 8)
    b = at + u * 18 * P
    return _nibble_groups(w, b + 2 * P), load_halves(w, b)


@njit(**_inline)
def unit_q4_1(w, at, u):
    # d, m, nibbles; weight = d q + m
    b = at + u * 20 * P
    return _nibble_groups(w, b + 4 * P), load_halves(w, b), load_halves(w, b + 2 * P)


@njit(**_inline)
def unit_q5_0(w, at, u):
    # d, fifth bits, nibbles; weight = d (q - 16)
    b = at + u * 22 * P
    return _with_fifth_bits(_nibble_groups(w, b + 6 * P), w, b + 2 * P), load_halves(w, b)


@njit(**_inline)
def unit_q5_1(w, at, u):
    # d, m, fifth bits, nibbles; weight = d q + m
    b = at + u * 24 * P
    return _with_fifth_bits(_nibble_groups(w, b + 8 * P), w, b + 4 * P), load_halves(w, b), load_halves(w, b + 2 * P)


@njit(**_inline)
def unit_q2_0(w, at, u):
    # ggml's Q2_0, two units a block: d, then each unit's codes; weight = d (code - 1)
    b = at + (u >> 1) * 18 * P
    return _crumb_groups(w, b + 2 * P + (u & 1) * 2 * L), load_halves(w, b)


@njit(**_inline)
def unit_q2_0_128(w, at, u):
    # PrismML's Q2_0, four units a block
    b = at + (u >> 2) * 34 * P
    return _crumb_groups(w, b + 2 * P + (u & 3) * 2 * L), load_halves(w, b)


@njit(**_inline)
def _k_factors(w, b, j):
    """Sub-block j's scale d·sc and offset -dmin·m of a Q4_K / Q5_K panel block at b: d and
    dmin (P halves each), then three words per output packing the eight six-bit scales and
    minimums (sub-blocks 0-3 in the low six bits of the bytes of words 0 and 1; 4-7 in the
    nibbles of word 2, their top two bits in the top bits of words 0 and 1). Both products
    are exact in float32."""
    w0, w1 = load_words(w, b + 4 * P), load_words(w, b + 8 * P)
    if j < 4:
        scale, minimum = field(w0, 8 * j, 63), field(w1, 8 * j, 63)
    else:
        w2 = load_words(w, b + 12 * P)
        at = 8 * (j - 4)
        scale = or_int(field(w2, at, 15), shifted_left(field(w0, at + 6, 3), 4))
        minimum = or_int(field(w2, at + 4, 15), shifted_left(field(w1, at + 6, 3), 4))
    dw = mul_float(load_halves(w, b), to_floats(scale))
    off = mul_float(times_splat(load_halves(w, b + 2 * P), -1.0), to_floats(minimum))
    return dw, off


@njit(**_inline)
def unit_q4_k(w, at, u):
    # eight units a block: d, dmin, scales, then each unit's nibbles
    b = at + (u >> 3) * 144 * P
    j = u & 7
    dw, off = _k_factors(w, b, j)
    return _nibble_groups(w, b + 16 * P + j * 4 * L), dw, off


@njit(**_inline)
def unit_q5_k(w, at, u):
    # d, dmin, scales, each unit's fifth bits, each unit's nibbles
    b = at + (u >> 3) * 176 * P
    j = u & 7
    dw, off = _k_factors(w, b, j)
    return _with_fifth_bits(_nibble_groups(w, b + 48 * P + j * 4 * L), w, b + 16 * P + j * L), dw, off


@njit(**_inline)
def unit_q6_k(w, at, u):
    # d, sixteen scales (P signed bytes each), each unit's nibbles, each unit's top-bit crumbs;
    # level = nibble | crumb << 4, weight = d · scale · (level - 32)
    b = at + (u >> 3) * 210 * P
    j = u & 7
    nib = _nibble_groups(w, b + 18 * P + j * 4 * L)
    c0, c1 = load_bytes(w, b + 146 * P + j * 2 * L), load_bytes(w, b + 146 * P + j * 2 * L + L)
    gs = (or_bytes(nib[0], shifted_up(c0, 4, 0x30)), or_bytes(nib[1], shifted_up(c0, 2, 0x30)),
          or_bytes(nib[2], bits_of_bytes(c0, 0, 0x30)), or_bytes(nib[3], bits_of_bytes(c0, 2, 0x30)),
          or_bytes(nib[4], shifted_up(c1, 4, 0x30)), or_bytes(nib[5], shifted_up(c1, 2, 0x30)),
          or_bytes(nib[6], bits_of_bytes(c1, 0, 0x30)), or_bytes(nib[7], bits_of_bytes(c1, 2, 0x30)))
    return (gs, load_halves(w, b), load_signed_bytes(w, b + 2 * P + 2 * j * P),
            load_signed_bytes(w, b + 2 * P + (2 * j + 1) * P))
