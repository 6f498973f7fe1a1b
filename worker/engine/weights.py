"""Weight matrices as the architecture files use them: repacked or read in place, multiplied by kernels.

* ``PanelWeight``: a 2-D matrix of a block type repacked in panels at load (``panels.py``), the
  layout of the GEMM kernels (``kernels/gemm.py``) for one row of x or thousands; the same
  bytes as the file's, which are let go once copied.
* ``QuantizedWeight``: a view of the file's own bytes (memory-mapped, read-only, never
  copied): [n_out, row bytes] of GGML blocks, or [experts, n_out, row bytes] for a stack of
  experts, which stays in the file so that a step reads only the experts it routes to;
  multiplied by the in-place kernels of ``kernels/matmul.py``. Float types (F32, F16, BF16)
  are always read in place.
* ``DenseWeight``: float32, the form of a tensor whose type has no kernel, or of every weight
  when the engine runs exactly (``exact=True``, parity checks: BLAS) or the CPU lacks AVX2.
  Outside exact mode its product is a compiled one whose rows are independent, as every
  other product here (BLAS sums a row differently by how many rows come with it).

All take a ``MatmulInput``, which quantizes its rows to int8 blocks once, on first use, so
the Q, K and V projections (or gate and up) share one quantization of their input.
"""

from __future__ import annotations

import copy

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from worker.engine import kernels, panels, q2_0
from worker.engine.kernels import gemm, matmul
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
# block type -> GEMM kernel over its panels
GEMM_KERNELS = {
    Q.Q4_0: gemm.gemm_q4_0,
    Q.Q4_1: gemm.gemm_q4_1,
    Q.Q5_0: gemm.gemm_q5_0,
    Q.Q5_1: gemm.gemm_q5_1,
    Q.Q8_0: gemm.gemm_q8_0,
    Q.Q4_K: gemm.gemm_q4_k,
    Q.Q5_K: gemm.gemm_q5_k,
    Q.Q6_K: gemm.gemm_q6_k,
    q2_0.Layout.Q2_0: gemm.gemm_q2_0,
    q2_0.Layout.Q2_0_128: gemm.gemm_q2_0_128,
}
# block type -> its GEMM without the tile loops, where that is a kernel of its own
FEW_ROWS_KERNELS = {Q.Q8_0: gemm.gemm_q8_0_rows}


def kernel_kind(qtype, layer_weights: dict) -> str:
    """Which GEMM a model's matrices of ``qtype`` take: ``gemm``, or ``rows``, the type's GEMM
    without the tile loop (``FEW_ROWS_KERNELS``), unless the type holds at least half of the
    layers' weights (``layer_weights``: weights of each block type, the embedding and the head
    left out). The tile loop is worth 1.2-1.3x on the matrices that take it and costs a first
    start 5-6 s of compiling: a head meets too few rows for it (the last of each sequence), and
    the few Q8_0 matrices of a file of other types (nine of gemma-3-270m Q4_K_M's 126) gave no
    prefill gain that showed. Either way the numbers are the same."""
    if qtype not in FEW_ROWS_KERNELS:
        return "gemm"
    share = layer_weights.get(qtype, 0)
    return "gemm" if share and 2 * share >= sum(layer_weights.values()) else "rows"


# float type -> its kind for the kernel taking float32 activations
FLOAT_KERNELS = {Q.F32: matmul.F32, Q.F16: matmul.F16, Q.BF16: matmul.BF16}
KERNEL_TYPES = frozenset(INT8_KERNELS) | frozenset(FLOAT_KERNELS)
# the record type of a row element of the 2-byte float types, as the compiled products take
# them (numba has no float16 arrays; a record type of its own also names the kernel)
FLOAT_RECORDS = {Q.F16: np.dtype([("f16", np.uint16)]), Q.BF16: np.dtype([("bf16", np.uint16)])}


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
            return matmul.matmul_float(FLOAT_KERNELS[self.qtype], self.kernel_array, inp.x, out)
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

    @property
    def kernel_array(self) -> np.ndarray:
        """A float matrix as the compiled block steps take it: float32 [n_out, n_in], or
        [n_out, n_in] of a 2-byte float's record type (``FLOAT_RECORDS``)."""
        if self.qtype == Q.F32:
            return self.data.view(np.float32)
        return self.data.view(FLOAT_RECORDS[self.qtype])

    def packed(self) -> Weight:
        """This matrix repacked in panels, if its type has them (else itself). The file's pages
        it was read from are not needed afterwards (``GGUFFile.release``)."""
        if not panels.packable(self.qtype, self.shape):
            return self
        return PanelWeight(self.qtype, self.shape, panels.pack(self.qtype, self.data))


class PanelWeight:
    """A 2-D weight repacked in panels (``panels.py``); ``panels`` [panels, blocks per row] of
    the type's panel-block records."""

    def __init__(self, qtype, shape: tuple[int, int], packed: np.ndarray):
        self.qtype = qtype
        self.shape = tuple(shape)
        self.panels = packed
        self.kernel = GEMM_KERNELS[qtype]

    def without_tiles(self) -> None:
        """Multiply by the type's GEMM without the tile loop (``FEW_ROWS_KERNELS``), if it has
        one: the panels' record type names it (``panels.block_dtype``), for the compiled block
        steps as for this weight's own products."""
        if self.qtype in FEW_ROWS_KERNELS:
            self.panels = self.panels.view(panels.block_dtype(self.qtype, rows=True))
            self.kernel = FEW_ROWS_KERNELS[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    @property
    def kernel_array(self) -> np.ndarray:
        return self.panels

    def times_transposed(self, x: np.ndarray | MatmulInput) -> np.ndarray:
        """x @ Wᵀ: [m, n_in] -> [m, n_out] float32."""
        acts = as_input(x).quantized
        out = np.empty((acts.values.shape[0], self.shape[0]), dtype=np.float32)
        return self.kernel(self.panels, *acts.parts, out)

    def row_range(self, start: int, stop: int) -> PanelWeight:
        """Output rows [start, stop), ``start`` a multiple of ``panels.PANEL``: a view of the panels
        holding them."""
        if start % panels.PANEL:
            raise ValueError(f"a panel weight's rows are taken from a multiple of {panels.PANEL}, not {start}")
        part = copy.copy(self)
        part.shape = (stop - start, self.shape[1])
        part.panels = self.panels[start // panels.PANEL:-(-stop // panels.PANEL)]
        return part

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` as float32 [len(ids), n_in] (an embedding lookup of a tied head)."""
        return panels.dequantize_rows(self.qtype, self.panels, np.asarray(ids))

    def dequantize(self) -> np.ndarray:
        return self.rows(np.arange(self.shape[0]))


class DenseWeight:
    """A float32 weight."""

    def __init__(self, values: np.ndarray, exact: bool = False):
        self.values = np.ascontiguousarray(values, dtype=np.float32)
        self.shape = self.values.shape
        # BLAS where exactness is what matters (parity checks); elsewhere the compiled product,
        # whose rows do not depend on one another
        self.exact = exact or not kernels.available() or self.values.ndim != 2

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    @property
    def kernel_array(self) -> np.ndarray:
        return self.values

    def times_transposed(self, x: np.ndarray | MatmulInput) -> np.ndarray:
        rows = x.x if isinstance(x, MatmulInput) else np.ascontiguousarray(x, dtype=np.float32)
        if self.exact:
            # (W @ xᵀ)ᵀ: OpenBLAS packs the few rows of x instead of the weight
            return (self.values @ rows.T).T
        out = np.empty((rows.shape[0], self.shape[0]), dtype=np.float32)
        return matmul.matmul_float(matmul.F32, self.values, rows, out)

    def expert(self, e: int) -> DenseWeight:
        return DenseWeight(self.values[e], self.exact)

    def row_range(self, start: int, stop: int) -> DenseWeight:
        return DenseWeight(self.values[start:stop], self.exact)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.values[np.asarray(ids)]

    def dequantize(self) -> np.ndarray:
        return self.values


Weight = QuantizedWeight | PanelWeight | DenseWeight


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
