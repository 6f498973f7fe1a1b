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
tiled and the single-row loops. Where the CPU has a tile unit (AMX, ``tiles.py``), a Q8_0
matrix's blocks of 16 rows take their integers I from it instead (the same exact integers) and
the same float steps (``panel_blocks.finish_*``). The activations are x's int8 form (``activations.py``):
values, their scale ``da`` and ``sa`` per unit, and the integer sums Σa per unit and per
16 values (``isums``, ``hsums``), which take the centre off (Q4_0's levels are q + 8, ...).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from worker.engine.kernels import panel_blocks as blocks
from worker.engine.kernels import tiles, use_tiles
from worker.engine.kernels.wide_simd import (PANEL, add_float, load_floats, load_words, put_floats, store_floats,
                                             zeros_float)

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


GROUP = 8  # units whose products a block of rows keeps at once (8 KiB: in the first-level cache)


@njit(**_inline)
def _ints(products, at):
    integer = load_words(products, at)
    return integer, integer


@njit(**_inline)
def _eight_rows(unit, finish, w, at, u0, u1, scales, sums, isums, hsums, r, products, i0, state):
    """Rows r..r+7 (rows i0..i0+7 of the block) through units u0..u1-1 from their integer
    products: each unit's factors decoded once for the eight, the running sums in registers
    (and in ``state``, 2 × 16 vectors, between groups of units)."""
    a0, l0 = _sums(state, i0)
    a1, l1 = _sums(state, i0 + 1)
    a2, l2 = _sums(state, i0 + 2)
    a3, l3 = _sums(state, i0 + 3)
    a4, l4 = _sums(state, i0 + 4)
    a5, l5 = _sums(state, i0 + 5)
    a6, l6 = _sums(state, i0 + 6)
    a7, l7 = _sums(state, i0 + 7)
    for u in range(u0, u1):
        d = unit(w, at, u)  # its levels, which ``finish`` does not take, the compiler leaves out
        c = 1024 * (u - u0) + 64 * i0
        a0, l0 = finish(d, _ints(products, c), scales, sums, isums, hsums, r, u, a0, l0)
        a1, l1 = finish(d, _ints(products, c + 64), scales, sums, isums, hsums, r + 1, u, a1, l1)
        a2, l2 = finish(d, _ints(products, c + 128), scales, sums, isums, hsums, r + 2, u, a2, l2)
        a3, l3 = finish(d, _ints(products, c + 192), scales, sums, isums, hsums, r + 3, u, a3, l3)
        a4, l4 = finish(d, _ints(products, c + 256), scales, sums, isums, hsums, r + 4, u, a4, l4)
        a5, l5 = finish(d, _ints(products, c + 320), scales, sums, isums, hsums, r + 5, u, a5, l5)
        a6, l6 = finish(d, _ints(products, c + 384), scales, sums, isums, hsums, r + 6, u, a6, l6)
        a7, l7 = finish(d, _ints(products, c + 448), scales, sums, isums, hsums, r + 7, u, a7, l7)
    _keep(state, i0, a0, l0)
    _keep(state, i0 + 1, a1, l1)
    _keep(state, i0 + 2, a2, l2)
    _keep(state, i0 + 3, a3, l3)
    _keep(state, i0 + 4, a4, l4)
    _keep(state, i0 + 5, a5, l5)
    _keep(state, i0 + 6, a6, l6)
    _keep(state, i0 + 7, a7, l7)


@njit(**_inline)
def _sums(state, i):
    """Row i of a block's running sums: acc, low."""
    return load_floats(state, PANEL * i), load_floats(state, PANEL * (tiles.ROWS + i))


@njit(**_inline)
def _keep(state, i, acc, low):
    put_floats(state, PANEL * i, acc)
    put_floats(state, PANEL * (tiles.ROWS + i), low)


@njit(parallel=True, nogil=True, cache=True)
def gemm_tiles(unit, tiles_of, finish, w, values, scales, sums, isums, hsums, out, config):
    """``gemm`` for m a multiple of 16 by the tile unit. For each panel and each block of 16 rows,
    GROUP units at a time: each unit's integer products with the block by one tile product
    (``tiles_of``), then the rows, eight at a time, take them through ``finish`` unit by unit."""
    m = values.shape[0]
    n_out = out.shape[1]
    panels, blocks_per_row = w.shape
    units = values.shape[1] // 32
    panel_bytes = blocks_per_row * w.itemsize
    for p in prange(panels):
        tiles.configure(config)
        at = p * panel_bytes
        first = p * PANEL
        count = min(PANEL, n_out - first)
        products = np.empty(GROUP * 1024, dtype=np.uint8)
        state = np.empty(2 * tiles.ROWS * PANEL, dtype=np.float32)
        for r in range(0, m, tiles.ROWS):
            state[:] = 0.0
            for u0 in range(0, units, GROUP):
                u1 = min(units, u0 + GROUP)
                for u in range(u0, u1):
                    tiles_of(w, at, u, values, r, products, 1024 * (u - u0))
                for i0 in range(0, tiles.ROWS, 8):
                    _eight_rows(unit, finish, w, at, u0, u1, scales, sums, isums, hsums, r + i0, products, i0, state)
            for i in range(tiles.ROWS):
                acc, low = _sums(state, i)
                store_floats(out[r + i], first, add_float(acc, low), count)
        tiles.release()
    return out


@njit(**_inline)
def _with_tiles(unit, row, tiles_of, finish, w, values, scales, sums, isums, hsums, out):
    """The rows in blocks of 16 by the tile unit, the rest by the vector loops: each row's
    numbers the same either way."""
    m = values.shape[0]
    tiled = m - m % tiles.ROWS
    if tiled:
        gemm_tiles(unit, tiles_of, finish, w, values[:tiled], scales[:tiled], sums[:tiled], isums[:tiled],
                   hsums[:tiled], out[:tiled], tiles.CONFIGURATION)
    if tiled < m:
        gemm(unit, row, w, values[tiled:], scales[tiled:], sums[tiled:], isums[tiled:], hsums[tiled:], out[tiled:])
    return out


@njit(**_inline)
def _vectors_only(unit, row, tiles_of, finish, w, values, scales, sums, isums, hsums, out):
    return gemm(unit, row, w, values, scales, sums, isums, hsums, out)


# chosen here, not in the compiled code: where there is no tile unit, nothing that names one compiles
_product = _with_tiles if use_tiles() else _vectors_only


# One entry point per type: each compiles only when a weight of its type is first multiplied.
# Only Q8_0 takes the tiles: 1.30x the vector loops' rate there (512 rows by 1,024 by 2,048 on a
# 2-core Sapphire Rapids), 1.17-1.19x a 2,048-token prefill of a Qwen3-0.6B-shaped Q8_0 file;
# the other types gained 0.96-1.56x in the product and nothing measurable in a prefill, and each
# type's tile loop costs a first start on a new machine some 10-15 seconds of compiling.
# (The decoders are passed as attributes of their module: a function of this module handed to
# the parallel loop would reach it as the address of a Python object, which numba's disk
# cache cannot keep.)

@njit(nogil=True, cache=True)
def gemm_q8_0(w, values, scales, sums, isums, hsums, out):
    return _product(blocks.unit_q8_0, blocks.row_signed, blocks.tiles_q8_0, blocks.finish_signed, w, values, scales,
                    sums, isums, hsums, out)


@njit(nogil=True, cache=True)
def gemm_q8_0_rows(w, values, scales, sums, isums, hsums, out):
    """``gemm_q8_0`` without the tile loop, for the Q8_0 matrices where that loop would not pay
    for its compiling (``weights.kernel_kind``: a head, a few matrices among other types). Its
    panels' record type is ``q8_0_rows``; it compiles in about a third of the time, and its
    numbers are the same."""
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
