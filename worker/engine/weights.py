"""Weight matrices as the architecture files use them: read in place, multiplied by kernels.

A ``QuantizedWeight`` is a view of the file's own bytes (memory-mapped, read-only, never
copied): [n_out, row bytes] of GGML blocks, or [experts, n_out, row bytes] for a stack of
experts. ``x @ Wᵀ`` runs the compiled kernel of its block type over those bytes. A
``DenseWeight`` holds float32 and multiplies with BLAS: the form of a tensor whose type has
no kernel, or of every weight when the engine runs exactly (``exact=True``, for parity
checks) or the CPU lacks AVX2.

Both take a ``MatmulInput``, which quantizes its rows to int8 blocks once, on first use, so
the Q, K and V projections (or gate and up) share one quantization of their input.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from worker.engine import q2_0
from worker.engine.kernels import matmul
from worker.engine.kernels.activations import QuantizedActivations

Q = GGMLQuantizationType

# block type -> kernel taking int8-quantized activations
INT8_KERNELS = {
    Q.Q4_0: matmul.matmul_q4_0,
    Q.Q4_1: matmul.matmul_q4_1,
    Q.Q5_0: matmul.matmul_q5_0,
    Q.Q5_1: matmul.matmul_q5_1,
    Q.Q8_0: matmul.matmul_q8_0,
    Q.Q4_K: matmul.matmul_q4_k,
    Q.Q5_K: matmul.matmul_q5_k,
    Q.Q6_K: matmul.matmul_q6_k,
    q2_0.Layout.Q2_0: matmul.matmul_q2_0,
    q2_0.Layout.Q2_0_128: matmul.matmul_q2_0_128,
}
# float type -> its kind for the kernel taking float32 activations
FLOAT_KERNELS = {Q.F32: matmul.F32, Q.F16: matmul.F16, Q.BF16: matmul.BF16}
KERNEL_TYPES = frozenset(INT8_KERNELS) | frozenset(FLOAT_KERNELS)


class MatmulInput:
    """Rows x [m, n] float32 about to meet one or more weights."""

    __slots__ = ("x", "_quantized")

    def __init__(self, x: np.ndarray):
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self._quantized: QuantizedActivations | None = None

    @property
    def quantized(self) -> QuantizedActivations:
        if self._quantized is None:
            self._quantized = QuantizedActivations(self.x)
        return self._quantized


def as_input(x: np.ndarray | MatmulInput) -> MatmulInput:
    return x if isinstance(x, MatmulInput) else MatmulInput(x)


def has_kernel(qtype: GGMLQuantizationType, n_in: int) -> bool:
    if qtype in INT8_KERNELS:
        return n_in % 32 == 0
    return qtype in FLOAT_KERNELS and n_in % 8 == 0


class QuantizedWeight:
    """A weight in its file's block format; ``data`` is a read-only view of the file."""

    def __init__(self, qtype: GGMLQuantizationType, shape: tuple[int, ...], data: np.ndarray):
        self.qtype = qtype
        self.shape = tuple(shape)  # numpy order: (n_out, n_in) or (experts, n_out, n_in)
        self.data = data  # uint8 [..., n_out, row bytes]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def times_transposed(self, x: np.ndarray | MatmulInput) -> np.ndarray:
        """x @ Wᵀ: [m, n_in] -> [m, n_out] float32."""
        if len(self.shape) != 2:
            raise ValueError(f"a {self.shape} stack multiplies one expert at a time (use .expert(e))")
        inp = as_input(x)
        out = np.empty((inp.x.shape[0], self.shape[0]), dtype=np.float32)
        if self.qtype in FLOAT_KERNELS:
            return matmul.matmul_float(FLOAT_KERNELS[self.qtype], self.data, inp.x, out)
        acts = inp.quantized
        return INT8_KERNELS[self.qtype](self.data, acts.values, acts.scales, acts.sums, out)

    def expert(self, e: int) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, self.shape[1:], self.data[e])

    def row_range(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop) of a 2-D weight (one half of a fused gate and up)."""
        return QuantizedWeight(self.qtype, (stop - start, self.shape[1]), self.data[start:stop])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of a 2-D weight as float32 [len(ids), n_in] (an embedding lookup)."""
        raw = self.data[np.asarray(ids)]
        if self.qtype == Q.Q8_0:  # the usual embedding type, once per step: numpy beats the generic decoder
            blocks = raw.reshape(len(ids), -1, 34)
            scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
            return (blocks[..., 2:].view(np.int8) * scales).reshape(len(ids), self.shape[-1])
        return dequantize(raw, self.qtype, (len(ids), self.shape[-1]))

    def dequantize(self) -> np.ndarray:
        return dequantize(self.data, self.qtype, self.shape)


class DenseWeight:
    """A float32 weight, multiplied with BLAS."""

    def __init__(self, values: np.ndarray):
        self.values = np.ascontiguousarray(values, dtype=np.float32)
        self.shape = self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def times_transposed(self, x: np.ndarray | MatmulInput) -> np.ndarray:
        rows = x.x if isinstance(x, MatmulInput) else x
        # (W @ xᵀ)ᵀ: OpenBLAS packs the few rows of x instead of the weight
        return (self.values @ rows.T).T

    def expert(self, e: int) -> DenseWeight:
        return DenseWeight(self.values[e])

    def row_range(self, start: int, stop: int) -> DenseWeight:
        return DenseWeight(self.values[start:stop])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.values[np.asarray(ids)]

    def dequantize(self) -> np.ndarray:
        return self.values


Weight = QuantizedWeight | DenseWeight


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """GGML bytes [..., row bytes] -> float32 of ``shape`` (the ``gguf`` package's decoders;
    Q2_0's, which it lacks, in ``q2_0.py``)."""
    if isinstance(qtype, q2_0.Layout):
        return q2_0.dequantize(raw, qtype.block, shape)
    if qtype == Q.F32:
        values = raw.view(np.float32)
    elif qtype == Q.F16:
        values = raw.view(np.float16)
    else:
        values = quants.dequantize(raw, qtype)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def row_bytes(qtype: GGMLQuantizationType, n_in: int) -> int:
    if isinstance(qtype, q2_0.Layout):
        return n_in // qtype.block * q2_0.LAYOUTS[qtype.block]
    block, size = GGML_QUANT_SIZES[qtype]
    return n_in // block * size
