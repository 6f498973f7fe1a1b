"""Weight matrices repacked into panels for the GEMM kernels (``kernels/gemm.py``).

A panel is PANEL consecutive output rows (``kernels/wide_simd.py``: 16 with AVX-512BW, else
8). A packed matrix is an array of *panel blocks* [panels, blocks per row], one numpy record
type per block type (so that the compiled code picks the kernel by the array's type, and
compiles only the kernels of the types a file holds). A panel block holds one block of the
file's format for every output of the panel, laid out for the kernel:

* per-output factors as lanes: PANEL halves (d, a Q4_1 minimum, ...), PANEL 32-bit words
  (the K-quants' twelve bytes of six-bit scales and minimums, as three words per output);
* the integer levels of each 32-weight unit as eight *group vectors* of LANES = 4 × PANEL
  bytes, group g holding weights 4g..4g+3 of every output side by side (lane 4·o + b:
  output o, weight 4g + b), stored at the file's own bit width:
  - bytes (Q8_0, signed);
  - nibbles, four LANES-byte vectors: the low nibbles group 2h, the high ones group 2h + 1;
  - a fifth bit (Q5_*): one LANES-bit mask per group, bit 4·o + b;
  - two-bit crumbs (Q6_K's top bits, Q2_0's codes), two LANES-byte vectors: bits 2k, 2k + 1 of
    vector c for group 4c + k.

Every type keeps its size to the byte (a panel block is PANEL file blocks), so memory stays
the file's. Rows past the last output (n_out not a multiple of PANEL) are zeros.

``pack`` turns file rows into panel blocks; ``unpack`` turns panel blocks back into file rows
(for embedding lookups of a tied head, and for anything that wants the file's bytes).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType

from worker.engine import q2_0
from worker.engine.kernels.wide_simd import LANES, PANEL

Q = GGMLQuantizationType

# Each packable type: weights per file block, bytes per file block, units (32 weights) per block.
FORMATS: dict[int, tuple[int, int]] = {
    Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34),
    Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210),
    q2_0.Layout.Q2_0: (64, 18), q2_0.Layout.Q2_0_128: (128, 34),
}
NAMES = {Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q5_0: "q5_0", Q.Q5_1: "q5_1", Q.Q8_0: "q8_0", Q.Q4_K: "q4_k",
         Q.Q5_K: "q5_k", Q.Q6_K: "q6_k", q2_0.Layout.Q2_0: "q2_0", q2_0.Layout.Q2_0_128: "q2_0_128"}
PANELS_PER_STEP = 64  # panels packed at once: bounds the temporaries of a large matrix


def block_dtype(qtype, rows: bool = False) -> np.dtype:
    """The record type of one panel block of ``qtype``: PANEL file blocks' bytes. Its name picks
    the GEMM (``kernels.fused.product``): ``q8_0``, or with ``rows`` ``q8_0_rows``, the same
    blocks multiplied without the tile loop (``weights.kernel_kind``)."""
    return np.dtype([(NAMES[qtype] + ("_rows" if rows else ""), np.uint8, (PANEL * FORMATS[qtype][1],))])


def packable(qtype, shape: tuple[int, ...]) -> bool:
    return qtype in FORMATS and len(shape) == 2 and shape[1] % FORMATS[qtype][0] == 0


def panel_count(n_out: int) -> int:
    return -(-n_out // PANEL)


# --- levels and factors of the file's blocks ---------------------------------------------------------

def _halves(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] uint16 (the bits of an f16)."""
    return np.ascontiguousarray(raw).view(np.uint16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] levels: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """[..., 4] little-endian bytes -> [..., count] bits, least significant first."""
    return np.unpackbits(np.ascontiguousarray(words), axis=-1, bitorder="little")[..., :count]


def _crumbs(codes: np.ndarray) -> np.ndarray:
    """[..., n] bytes of 2-bit codes -> [..., 4n] (code j in bits 2·(j % 4) of byte j // 4)."""
    shifts = np.array([0, 2, 4, 6], np.uint8)
    return ((codes[..., :, None] >> shifts) & 3).reshape(*codes.shape[:-1], -1)


def levels_and_factors(qtype, blocks: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """File blocks [rows, blocks, bytes] -> the integer levels [rows, blocks, weights per block]
    (uint8; Q8_0's as int8 bits) and the factor fields by name (raw bytes, as they pack)."""
    if qtype == Q.Q8_0:
        return blocks[..., 2:], {"d": blocks[..., :2]}
    if qtype in (Q.Q4_0, Q.Q4_1):
        head = 2 if qtype == Q.Q4_0 else 4
        return _nibbles(blocks[..., head:]), {"d": blocks[..., :head]}
    if qtype in (Q.Q5_0, Q.Q5_1):
        head = 2 if qtype == Q.Q5_0 else 4
        fifth = _bits(blocks[..., head:head + 4], 32)
        return _nibbles(blocks[..., head + 4:]) | (fifth << 4), {"d": blocks[..., :head]}
    if qtype in (Q.Q4_K, Q.Q5_K):
        nibbles_at = 16 if qtype == Q.Q4_K else 48
        packed = blocks[..., nibbles_at:nibbles_at + 128].reshape(*blocks.shape[:2], 4, 32)
        # sub-blocks 2i and 2i + 1 are the low and high nibbles of the i-th 32 bytes
        levels = np.stack([packed & 0x0F, packed >> 4], axis=-2).reshape(*blocks.shape[:2], 256)
        if qtype == Q.Q5_K:
            high = blocks[..., 16:48]  # bit j of byte l: weight l of sub-block j
            levels = levels | (((high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).reshape(
                *blocks.shape[:2], 256)
        return levels, {"d": blocks[..., :4], "scales": blocks[..., 4:16]}
    if qtype == Q.Q6_K:
        ql = blocks[..., :128].reshape(*blocks.shape[:2], 2, 2, 32)  # half, which 32, byte
        qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 32)
        groups = []
        for group in range(4):  # group k of each half: nibbles of ql[k % 2], bits 2k of qh
            low = ql[..., group % 2, :] & 0x0F if group < 2 else ql[..., group % 2, :] >> 4
            groups.append(low | (((qh >> (2 * group)) & 3) << 4))
        levels = np.stack(groups, axis=-2).reshape(*blocks.shape[:2], 256)  # half, group, byte
        return levels, {"scales": blocks[..., 192:208], "d": blocks[..., 208:210]}
    if isinstance(qtype, q2_0.Layout):
        return _crumbs(blocks[..., 2:]), {"d": blocks[..., :2]}
    raise ValueError(f"{qtype!r} has no panel layout")


# --- packing ---------------------------------------------------------------------------------

def _group_vectors(levels: np.ndarray) -> np.ndarray:
    """Levels [panels * PANEL, blocks, w] -> [panels, blocks, w/32 units, 8 groups, LANES]
    (lane 4·o + b holds weight 4g + b of output o). Moved as 32-bit words, one per lane."""
    n, blocks, width = levels.shape
    if levels.strides[-1] != 1:
        levels = np.ascontiguousarray(levels)
    words = levels.view(np.uint32)  # [n, blocks, w / 4] (a view where each block's levels are contiguous)
    per_unit = words.reshape(n // PANEL, PANEL, blocks, width // 32, 8)
    moved = np.ascontiguousarray(per_unit.transpose(0, 2, 3, 4, 1))
    return moved.view(np.uint8).reshape(n // PANEL, blocks, width // 32, 8, LANES)


def _pack_nibbles(groups: np.ndarray) -> np.ndarray:
    """[..., 8, LANES] levels -> [..., 4 * LANES] bytes: vector h is group 2h (low) and 2h+1 (high)."""
    low, high = groups[..., 0::2, :] & 0x0F, groups[..., 1::2, :] & 0x0F
    return (low | (high << 4)).reshape(*groups.shape[:-2], 4 * LANES)


def _q4_k_nibble_vectors(blocks: np.ndarray) -> np.ndarray:
    """Q4_K file blocks [panels * PANEL, blocks, 144] -> their nibble vectors [panels, blocks,
    8 units · 4 · LANES] straight from the file's nibbles, as 32-bit words: what ``_pack_nibbles``
    makes of ``_group_vectors(levels)``, without spelling out the levels. In the file, byte l
    of the i-th 32 holds weight l of sub-block 2i (low nibble) and of 2i + 1 (high); a vector h
    of a unit pairs weight 8h + b (low) with 8h + 4 + b (high) in byte b of each output's word:
    the nibbles of the file's words 2h and 2h + 1."""
    n, n_blocks, _ = blocks.shape
    words = blocks[..., 16:144].view(np.uint32).reshape(n, n_blocks, 4, 4, 2)  # 32 bytes, h, word of h
    first, second = words[..., 0], words[..., 1]
    low = np.uint32(0x0F0F0F0F)
    units = np.stack([(first & low) | ((second & low) << 4),  # sub-block 2i
                      ((first >> 4) & low) | (second & ~low)], axis=3)  # sub-block 2i + 1
    per_panel = units.reshape(n // PANEL, PANEL, n_blocks, 8, 4)
    moved = np.ascontiguousarray(per_panel.transpose(0, 2, 3, 4, 1))
    return moved.view(np.uint8).reshape(n // PANEL, n_blocks, -1)


def _pack_crumbs(groups: np.ndarray, shift: int) -> np.ndarray:
    """[..., 8, LANES] levels -> [..., 2 * LANES]: bits 2k of vector c are (level >> shift) & 3 of
    group 4c + k."""
    crumbs = ((groups >> shift) & 3).reshape(*groups.shape[:-2], 2, 4, LANES)
    packed = crumbs[..., 0, :] | (crumbs[..., 1, :] << 2) | (crumbs[..., 2, :] << 4) | (crumbs[..., 3, :] << 6)
    return packed.reshape(*groups.shape[:-2], 2 * LANES)


def _pack_bits(groups: np.ndarray, bit: int) -> np.ndarray:
    """[..., 8, LANES] levels -> [..., LANES]: each group's ``bit`` as LANES bits."""
    return np.packbits((groups >> bit) & 1, axis=-1, bitorder="little").reshape(*groups.shape[:-2], LANES)


def _lanes(field: np.ndarray, lane_bytes: int) -> np.ndarray:
    """A per-output field [panels * PANEL, blocks, k bytes] -> [panels, blocks, PANEL * k]: the
    field cut into ``lane_bytes``-wide pieces, each piece as one lane per output (piece-major)."""
    n, blocks, k = field.shape
    pieces = field.reshape(n // PANEL, PANEL, blocks, k // lane_bytes, lane_bytes)
    return pieces.transpose(0, 2, 3, 1, 4).reshape(n // PANEL, blocks, PANEL * k)


def _pack_panels(qtype, rows: np.ndarray, dest: np.ndarray) -> None:
    """File rows [panels * PANEL, row bytes] -> their panels' blocks, written into ``dest``
    [panels, blocks, PANEL * block bytes]."""
    weights, size = FORMATS[qtype]
    blocks = rows.reshape(rows.shape[0], -1, size)
    if qtype == Q.Q4_K:  # d and dmin, the scales' three words, the nibbles moved as words
        parts = [_lanes(blocks[..., :4], 2), _lanes(blocks[..., 4:16], 4), _q4_k_nibble_vectors(blocks)]
        _write_parts(parts, dest, size)
    else:
        pack_by_levels(qtype, blocks, dest)


def pack_by_levels(qtype, blocks: np.ndarray, dest: np.ndarray) -> None:
    """``_pack_panels`` of file blocks [panels * PANEL, blocks, bytes] through their levels, for
    every type (Q4_K's too, which ``_pack_panels`` moves as words instead, to the same bytes)."""
    size = blocks.shape[-1]
    levels, factors = levels_and_factors(qtype, blocks)
    groups = _group_vectors(levels)  # [panels, blocks, units, 8, LANES]
    parts = [_lanes(factors["d"], 2)]  # d (and a minimum or dmin after it)
    if qtype == Q.Q6_K:
        parts += [_lanes(factors["scales"], 1), _pack_nibbles(groups), _pack_crumbs(groups, 4)]
    elif qtype in (Q.Q4_K, Q.Q5_K):
        parts.append(_lanes(factors["scales"], 4))  # three words
        if qtype == Q.Q5_K:
            parts.append(_pack_bits(groups, 4))
        parts.append(_pack_nibbles(groups))
    elif qtype == Q.Q8_0:
        parts.append(groups)
    elif isinstance(qtype, q2_0.Layout):
        parts.append(_pack_crumbs(groups, 0))
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        if qtype in (Q.Q5_0, Q.Q5_1):
            parts.append(_pack_bits(groups, 4))
        parts.append(_pack_nibbles(groups))
    _write_parts(parts, dest, size)


def _write_parts(parts: list[np.ndarray], dest: np.ndarray, size: int) -> None:
    """The fields of the panels' blocks side by side in ``dest`` [panels, blocks, PANEL · size]."""
    panels, n_blocks = dest.shape[:2]
    at = 0
    for part in parts:
        part = part.reshape(panels, n_blocks, -1)
        dest[..., at:at + part.shape[-1]] = part
        at += part.shape[-1]
    assert at == PANEL * size


def pack(qtype, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """File rows [n_out, row bytes] -> panel blocks [panels, blocks per row] of ``block_dtype``.
    Works a few panels at a time, so a large matrix needs little more than its packed copy."""
    n_out, row = rows.shape
    size = FORMATS[qtype][1]
    panels = panel_count(n_out)
    if out is None:
        out = np.empty((panels, row // size), dtype=block_dtype(qtype))
    flat = out.view(np.uint8).reshape(panels, row // size, -1)

    def step(first: int) -> None:
        last = min(panels, first + PANELS_PER_STEP)
        chunk = rows[first * PANEL:last * PANEL]
        if chunk.shape[0] < (last - first) * PANEL:  # the last panel's missing outputs are zeros
            chunk = np.concatenate([chunk, np.zeros(((last - first) * PANEL - chunk.shape[0], row), np.uint8)])
        _pack_panels(qtype, chunk, flat[first:last])

    starts = range(0, panels, PANELS_PER_STEP)
    if len(starts) == 1:
        step(0)
    else:  # numpy lets go of the GIL while it copies: the steps share the cores
        list(_packers().map(step, starts))
    return out


@functools.cache
def _packers() -> ThreadPoolExecutor:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=cores, thread_name_prefix="pack")


# --- reading rows back ---------------------------------------------------------------------------

def _lane_of(vectors: np.ndarray, lane: np.ndarray, width: int) -> np.ndarray:
    """From vectors [k, ..., PANEL * width] the ``width`` bytes of output ``lane[i]`` of row i."""
    split = vectors.reshape(*vectors.shape[:-1], PANEL, width)
    return np.take_along_axis(split, lane.reshape(-1, *([1] * (split.ndim - 1))), axis=-2)[..., 0, :]


def dequantize_rows(qtype, packed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Output rows ``ids`` of a packed matrix as float32 [len(ids), n_in]: the integer levels
    and factors of each row's lane, through the type's own formula."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    weights, size = FORMATS[qtype]
    panel, lane = np.divmod(ids, PANEL)
    raw = packed.view(np.uint8).reshape(packed.shape[0], packed.shape[1], PANEL * size)[panel]
    k, n_blocks = raw.shape[:2]
    units = weights // 32
    P, L = PANEL, LANES

    def halves(at: int, count: int = 1) -> np.ndarray:  # [k, blocks, count] f32 of this lane
        field = raw[..., at:at + 2 * P * count].reshape(k, n_blocks, count, 2 * P)
        return _lane_of(field, lane, 2).copy().view(np.float16)[..., 0].astype(np.float32)

    def group_bytes(at: int) -> np.ndarray:  # [k, blocks, units, 8, 4] bytes of whole group vectors
        field = raw[..., at:at + units * 8 * L].reshape(k, n_blocks, units, 8, L)
        return _lane_of(field, lane, 4)

    def nibble_groups(at: int) -> np.ndarray:
        field = _lane_of(raw[..., at:at + units * 4 * L].reshape(k, n_blocks, units, 4, L), lane, 4)
        return np.stack([field & 0x0F, field >> 4], axis=-2).reshape(k, n_blocks, units, 8, 4)

    def crumb_groups(at: int) -> np.ndarray:
        field = _lane_of(raw[..., at:at + units * 2 * L].reshape(k, n_blocks, units, 2, L), lane, 4)
        crumbs = [(field >> (2 * j)) & 3 for j in range(4)]
        return np.stack(crumbs, axis=-2).reshape(k, n_blocks, units, 8, 4)

    def fifth_bits(at: int) -> np.ndarray:
        field = raw[..., at:at + units * L].reshape(k, n_blocks, units, 8, L // 8)
        bits = np.unpackbits(field, axis=-1, bitorder="little")  # [..., LANES]
        return _lane_of(bits, lane, 4)

    if qtype == Q.Q8_0:
        levels = group_bytes(2 * P).view(np.int8).astype(np.float32)
        return (levels.reshape(k, n_blocks, 32) * halves(0)).reshape(k, -1)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        fifth = qtype in (Q.Q5_0, Q.Q5_1)
        with_min = qtype in (Q.Q4_1, Q.Q5_1)
        head = 4 * P if with_min else 2 * P
        levels = nibble_groups(head + (L if fifth else 0))
        if fifth:
            levels = levels | (fifth_bits(head) << 4)
        levels = levels.reshape(k, n_blocks, 32).astype(np.float32)
        d = halves(0)
        if with_min:
            return (levels * d + halves(2 * P)).reshape(k, -1)
        return ((levels - (16 if fifth else 8)) * d).reshape(k, -1)
    if isinstance(qtype, q2_0.Layout):
        levels = crumb_groups(2 * P).reshape(k, n_blocks, weights).astype(np.float32)
        return ((levels - 1) * halves(0)).reshape(k, -1)
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = halves(0)[..., 0], halves(2 * P)[..., 0]
        words = _lane_of(raw[..., 4 * P:16 * P].reshape(k, n_blocks, 3, 4 * P), lane, 4)  # [k, blocks, 3, 4]
        scales, mins = _k_scales_and_mins(words.reshape(k, n_blocks, 12))
        if qtype == Q.Q4_K:
            levels = nibble_groups(16 * P)
        else:
            levels = nibble_groups(48 * P) | (fifth_bits(16 * P) << 4)
        levels = levels.reshape(k, n_blocks, 8, 32).astype(np.float32)
        out = levels * (d[..., None] * scales)[..., None] - (dmin[..., None] * mins)[..., None]
        return out.reshape(k, -1)
    if qtype == Q.Q6_K:
        d = halves(0)[..., 0]
        scales = _lane_of(raw[..., 2 * P:18 * P].reshape(k, n_blocks, 16, P), lane, 1)[..., 0].view(np.int8)
        levels = nibble_groups(18 * P) | (crumb_groups(146 * P) << 4)
        levels = levels.reshape(k, n_blocks, 16, 16).astype(np.float32) - 32
        return (levels * (d[..., None] * scales)[..., None]).reshape(k, -1)
    raise ValueError(f"{qtype!r} has no panel layout")


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quants' twelve bytes [..., 12] -> six-bit scales and minimums [..., 8] as float32
    (sub-blocks 0-3 in the low six bits of bytes 0-3 and 4-7; 4-7 in the nibbles of bytes
    8-11, their top two bits in the top bits of bytes 0-3 and 4-7)."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)
