"""y = x Wᵀ for W repacked in panels (``panels.py``), for any number of rows of x.

A thread takes a panel (PANEL outputs) at a time; rows of x go four at a time, then one by
one. For each 32-weight unit the panel's levels are decoded once into eight group vectors
(``wide_simd.py``) and met by every row of the tile: one int8 dot product per group and row
adds four weights of every output at once, with the row's four activation bytes broadcast.

Every output of every row is the same sequence of operations, whatever the rows beside it,
their number or the CPU (the integers are exact):

    acc = 0, low = 0
    for each unit u of the row, in order:
        I   = Σ level · a over the unit, the type's centre taken off (an exact integer)
        acc = fma(fl(dw · da), float(I), acc)       dw: the unit's weight scale, da: x's
        low = fma(off, sa, low)                     types with a minimum (off; sa = da · Σa)
    y = acc + low

so a stream's numbers are the same alone, in a batch, in any prefill chunk, and in the
tiled and the single-row loops. The activations are x's int8 form (``activations.py``):
values, their scale ``da`` and ``sa`` per unit, and the integer sums Σa per unit and per
16 values (``isums``, ``hsums``), which take the centre off (Q4_0's levels are q + 8, ...).
"""

from __future__ import annotations

from numba import njit, prange

from worker.engine.kernels import panel_blocks as blocks
from worker.engine.kernels.wide_simd import PANEL, add_float, store_floats, zeros_float

TILE = 4  # rows of x that meet each decoded unit
_inline = dict(inline="always", cache=True)

# --- the loops -------------------------------------------------------------------------------

@njit(**_inline)
def _tile(unit, row, w, at, units, values, scales, sums, isums, hsums, r):
    """Rows r..r+3 against one panel: each unit decoded once for the four."""
    a0 = a1 = a2 = a3 = zeros_float()
    l0 = l1 = l2 = l3 = zeros_float()
    for u in range(units):
        decoded = unit(w, at, u)
        a0, l0 = row(decoded, values, scales, sums, isums, hsums, r, u, a0, l0)
        a1, l1 = row(decoded, values, scales, sums, isums, hsums, r + 1, u, a1, l1)
        a2, l2 = row(decoded, values, scales, sums, isums, hsums, r + 2, u, a2, l2)
        a3, l3 = row(decoded, values, scales, sums, isums, hsums, r + 3, u, a3, l3)
    return add_float(a0, l0), add_float(a1, l1), add_float(a2, l2), add_float(a3, l3)


@njit(**_inline)
def _single(unit, row, w, at, units, values, scales, sums, isums, hsums, r):
    acc = low = zeros_float()
    for u in range(units):
        acc, low = row(unit(w, at, u), values, scales, sums, isums, hsums, r, u, acc, low)
    return add_float(acc, low)


@njit(parallel=True, nogil=True, cache=True)
def gemm(unit, row, w, values, scales, sums, isums, hsums, out):
    """w [panels, blocks] panel blocks; values [m, n] int8; scales, sums, isums [m, n/32];
    hsums [m, n/16]; out [m, n_out] (n_out <= panels · PANEL)."""
    m = values.shape[0]
    n_out = out.shape[1]
    panels, blocks = w.shape
    units = values.shape[1] // 32
    panel_bytes = blocks * w.itemsize
    tiled = m - m % TILE
    for p in prange(panels):
        at = p * panel_bytes
        first = p * PANEL
        count = min(PANEL, n_out - first)
        for r in range(0, tiled, TILE):
            y0, y1, y2, y3 = _tile(unit, row, w, at, units, values, scales, sums, isums, hsums, r)
            store_floats(out[r], first, y0, count)
            store_floats(out[r + 1], first, y1, count)
            store_floats(out[r + 2], first, y2, count)
            store_floats(out[r + 3], first, y3, count)
        for r in range(tiled, m):
            store_floats(out[r], first, _single(unit, row, w, at, units, values, scales, sums, isums, hsums, r),
                         count)
    return out


# One entry point per type: each compiles only when a weight of its type is first multiplied.
# (The decoders are passed as attributes of their module: a function of this module handed to
# the parallel loop would reach it as the address of a Python object, which numba's disk
# cache cannot keep.)

@njit(nogil=True, cache=True)
def gemm_q8_0(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q8_0, blocks.row_signed, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q4_0(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q4_0, blocks.row_centred_8, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q4_1(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q4_1, blocks.row_with_minimum, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q5_0(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q5_0, blocks.row_centred_16, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q5_1(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q5_1, blocks.row_with_minimum, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q2_0(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q2_0, blocks.row_centred_1, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q2_0_128(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q2_0_128, blocks.row_centred_1, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q4_k(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q4_k, blocks.row_with_minimum, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q5_k(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q5_k, blocks.row_with_minimum, w, values, scales, sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q6_k(w, values, scales, sums, isums, hsums, out):
    return gemm(blocks.unit_q6_k, blocks.row_half_scaled, w, values, scales, sums, isums, hsums, out)
