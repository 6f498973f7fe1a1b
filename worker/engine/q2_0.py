"""Q2_0 (GGUF type id 42): ternary weights, two layouts under one id.

Each block is an f16 scale ``d`` and 2-bit codes, four to a byte, weight j in bits
``2·(j % 4)`` of byte ``j // 4``; a weight is ``(code - 1) · d`` (codes 0, 1, 2 for −1, 0, +1).
ggml's own blocks hold 64 weights in 18 bytes; PrismML's (Ternary-Bonsai) 128 in 34. The file
does not say which: the bytes each Q2_0 tensor occupies do (``layout``), the space from its
offset to the next tensor's (or the end of the data), which is its size plus at most the
alignment's padding. The ``gguf`` package knows neither (its type enum stops before 42), so the
tensor table is read by ``gguf_file`` and the blocks are decoded here.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from shared.errors import ModelLoadError

TYPE_ID = 42
LAYOUTS = {64: 18, 128: 34}  # weights per block -> bytes per block


class Layout(IntEnum):
    """The two layouts as a weight's block type (``QuantizedWeight.qtype``): numbers of their
    own, clear of GGML's type ids, since both are id 42 in a file."""

    Q2_0 = 1064
    Q2_0_128 = 1128

    @property
    def block(self) -> int:
        return self.value - 1000

    @classmethod
    def of(cls, block: int) -> Layout:
        return cls(1000 + block)


def n_bytes(n_values: int, row: int, block: int) -> int | None:
    """A tensor's bytes in the layout, or None where its rows (``row`` values each) do not
    split into whole blocks (a block never spans two rows)."""
    return None if row % block else n_values // block * LAYOUTS[block]


def layout(tensors: list[tuple[str, int, int, int]], alignment: int, path: str) -> int:
    """The block size (64 or 128) every Q2_0 tensor of a file fits: (name, values, values per
    row, bytes from its offset to the next tensor's or the data's end) each. Where both fit
    every tensor (tiny tensors can), ggml's own 64 is taken."""
    fitting = []
    for block in LAYOUTS:
        sizes = [(n_bytes(values, row, block), room) for _, values, row, room in tensors]
        if all(size is not None and size <= room < size + alignment for size, room in sizes):
            fitting.append(block)
    if not fitting:
        for name, values, row, room in tensors:
            sizes = [n_bytes(values, row, block) for block in LAYOUTS]
            if all(size is not None and room < size for size in sizes):
                raise ModelLoadError(f"{path} is truncated: Q2_0 tensor {name!r} ({values} values) has only "
                                     f"{room} bytes")
            if not any(size is not None and size <= room < size + alignment for size in sizes):
                raise ModelLoadError(f"{path}: Q2_0 tensor {name!r} ({values} values) occupies {room} bytes, "
                                     f"which fits neither Q2_0 layout (64 values in 18 bytes, or 128 in 34)")
        raise ModelLoadError(f"{path}: its Q2_0 tensors fit no one layout: some fit only 64-value blocks, "
                             f"others only 128-value ones")
    return min(fitting)


def dequantize(raw: np.ndarray, block: int, shape: tuple[int, ...]) -> np.ndarray:
    """Q2_0 bytes as float32 of ``shape``."""
    blocks = raw.reshape(-1, LAYOUTS[block])
    scales = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)  # [n, 1]
    packed = blocks[:, 2:]
    codes = np.stack([(packed >> (2 * k)) & 3 for k in range(4)], axis=-1).reshape(len(blocks), block)
    return ((codes.astype(np.float32) - 1.0) * scales).reshape(shape)


def quantize(values: np.ndarray, block: int) -> np.ndarray:
    """Ternary blocks of ``values`` [rows, n] (n a multiple of ``block``): d the block's largest
    magnitude, each weight rounded to −d, 0 or +d. Returns uint8 [rows, row bytes]."""
    if values.shape[-1] % block:
        raise ValueError(f"rows of {values.shape[-1]} values do not split into blocks of {block}")
    rows = values.reshape(-1, block).astype(np.float32)
    d = np.abs(rows).max(axis=1, keepdims=True)
    codes = (np.rint(np.divide(rows, d, out=np.zeros_like(rows), where=d > 0)) + 1).clip(0, 2).astype(np.uint8)
    codes = codes.reshape(len(rows), block // 4, 4)
    packed = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), packed], axis=1)
    return out.reshape(values.shape[0], -1)
