"""The GEMM over panels (kernels/gemm.py) and the panel layout (panels.py), type by type.

References are independent of the kernel: the ``gguf`` package's dequantizers (or q2_0.py's)
for the weights, and the product of the dequantized weights with the dequantized int8
activations in float64, which the kernel must meet to float rounding. Shapes are odd on
purpose: output counts that leave the last panel part-empty, rows of one unit past whole tiles,
batches of 1 to 70 rows (tiles of four and single rows), rows of many blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from numba import njit
from test_kernels import block_size, random_blocks, row_width

from worker.engine import kernels, panels, q2_0
from worker.engine.kernels import fused
from worker.engine.kernels.activations import QuantizedActivations
from worker.engine.kernels.wide_simd import PANEL
from worker.engine.weights import GEMM_KERNELS, MatmulInput, QuantizedWeight, dequantize

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")

TYPES = sorted(GEMM_KERNELS, key=lambda q: q.name)
ROWS = (1, 2, 3, 4, 5, 9, 70)


def _weight(qtype, n_out: int, units: int, seed: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    n_in = row_width(qtype, units)
    return random_blocks(qtype, n_out, n_in, rng), n_in


def _reference(raw: np.ndarray, qtype, acts: QuantizedActivations) -> np.ndarray:
    dense = dequantize(raw, qtype, (raw.shape[0], acts.values.shape[1])).astype(np.float64)
    x = acts.values.astype(np.float64) * np.repeat(acts.scales, 32, axis=1)
    return x @ dense.T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packing_keeps_every_weight_and_the_file_size(qtype):
    raw, n_in = _weight(qtype, 2 * PANEL + 5, 13, int(qtype))
    packed = panels.pack(qtype, raw)
    assert packed.dtype == panels.block_dtype(qtype) and packed.shape[0] == 3
    # a panel block is PANEL of the file's blocks: the same bytes per weight
    assert packed.nbytes == 3 * PANEL * raw.shape[1]
    dense = dequantize(raw, qtype, (raw.shape[0], n_in))
    np.testing.assert_array_equal(panels.dequantize_rows(qtype, packed, np.arange(raw.shape[0])), dense)
    ids = np.array([PANEL + 3, 0, 2 * PANEL + 4, PANEL + 3])
    np.testing.assert_array_equal(panels.dequantize_rows(qtype, packed, ids), dense[ids])


def test_q4_k_panels_moved_as_words_are_those_made_through_levels():
    """Q4_K's nibbles go into their vectors as 32-bit words (``_pack_panels``), byte for byte
    what the path every type takes (levels, group vectors, nibbles packed again) makes, on
    random bytes: every nibble of every block, outputs that leave the last panel part-empty."""
    rng = np.random.default_rng(4)
    for n_out, n_blocks in ((3 * PANEL - 5, 3), (1, 1), (2 * PANEL, 7)):
        rows = rng.integers(0, 256, (n_out, n_blocks * 144), dtype=np.uint8)
        by_words = panels.pack(Q.Q4_K, rows)
        padded = np.zeros((panels.panel_count(n_out) * PANEL, n_blocks * 144), dtype=np.uint8)
        padded[:n_out] = rows
        by_levels = np.zeros_like(by_words).view(np.uint8).reshape(by_words.shape[0], n_blocks, -1)
        panels.pack_by_levels(Q.Q4_K, padded.reshape(-1, n_blocks, 144), by_levels)
        np.testing.assert_array_equal(by_words.view(np.uint8).reshape(by_levels.shape), by_levels)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gemm_matches_the_dequantized_product(qtype):
    raw, n_in = _weight(qtype, 37, 11, 10 + int(qtype))  # 37 outputs: the last panel part-empty
    packed = panels.pack(qtype, raw)
    rng = np.random.default_rng(int(qtype))
    for m in ROWS:
        acts = QuantizedActivations(rng.standard_normal((m, n_in)).astype(np.float32))
        out = np.full((m, 40), np.nan, dtype=np.float32)
        GEMM_KERNELS[qtype](packed, *acts.parts, out[:, :37])
        exact = _reference(raw, qtype, acts)
        np.testing.assert_allclose(out[:, :37], exact, atol=2e-5 * np.abs(exact).max(), rtol=0)
        assert np.isnan(out[:, 37:]).all(), "a part-empty panel wrote past the last output"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_gets_the_same_bits_alone_in_a_tile_and_in_any_batch(qtype):
    """A row's result is the same sequence of operations wherever it sits: in a tile of four,
    in the single-row loop, alone, among 70 (batch invariance and chunked prefill rest on it)."""
    raw, n_in = _weight(qtype, 29, 33, 20 + int(qtype))
    packed = panels.pack(qtype, raw)
    rng = np.random.default_rng(30 + int(qtype))
    x = rng.standard_normal((70, n_in)).astype(np.float32)
    kernel = GEMM_KERNELS[qtype]

    def product(rows: np.ndarray) -> np.ndarray:
        out = np.empty((rows.shape[0], 29), dtype=np.float32)
        return kernel(packed, *QuantizedActivations(rows).parts, out)

    everything = product(x)
    for r in (0, 3, 66, 69):  # first and last of a tile, the last tile, the single-row tail
        np.testing.assert_array_equal(product(x[r:r + 1])[0], everything[r])
    np.testing.assert_array_equal(product(x[1:6]), everything[1:6])  # a tile and a tail elsewhere


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_the_panel_weight_serves_products_lookups_and_the_compiled_steps(qtype):
    raw, n_in = _weight(qtype, 3 * PANEL, 8, 40 + int(qtype))
    weight = QuantizedWeight(qtype, (3 * PANEL, n_in), raw).packed()
    assert weight.nbytes == raw.nbytes and weight.shape == (3 * PANEL, n_in)
    dense = dequantize(raw, qtype, weight.shape)
    np.testing.assert_array_equal(weight.dequantize(), dense)
    np.testing.assert_array_equal(weight.rows(np.array([5, 0, 5])), dense[[5, 0, 5]])
    x = np.random.default_rng(1).standard_normal((6, n_in)).astype(np.float32)
    inp = MatmulInput(x)
    got = weight.times_transposed(inp)
    np.testing.assert_allclose(got, _reference(raw, qtype, inp.quantized), atol=2e-5 * np.abs(got).max(), rtol=0)
    # the compiled block steps pick the same kernel by the array's type
    out = np.empty_like(got)
    np.testing.assert_array_equal(_compiled_product(weight.kernel_array, x, inp.quantized.parts, out), got)


@njit
def _compiled_product(weights, x, acts, out):
    return fused.product(weights, x, acts, out)


def test_every_type_with_a_panel_layout_has_a_kernel_and_the_reverse():
    assert set(panels.FORMATS) == set(GEMM_KERNELS)
    for qtype in panels.FORMATS:
        weights, size = panels.FORMATS[qtype]
        assert weights == block_size(qtype)
        assert panels.block_dtype(qtype).itemsize == PANEL * size
    assert panels.packable(Q.Q4_K, (8, 512)) and not panels.packable(Q.Q4_K, (3, 8, 512))
    assert not panels.packable(Q.F16, (8, 64)) and panels.packable(q2_0.Layout.Q2_0_128, (8, 256))
