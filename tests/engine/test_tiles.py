"""The tile unit (AMX) in the GEMM (Q8_0's): its products are the exact integers, and a row that
goes through it gets the bits it gets from the vector loops (alone, where it never does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit
from test_kernels import random_blocks, row_width

from worker.engine import kernels, panels
from worker.engine.kernels import cache_directory, tiles
from worker.engine.kernels.activations import QuantizedActivations
from worker.engine.weights import FEW_ROWS_KERNELS, GEMM_KERNELS

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")
needs_tiles = pytest.mark.skipif(not kernels.use_tiles(), reason="this CPU (or its kernel) has no AMX tiles")
TYPES = sorted(GEMM_KERNELS, key=lambda q: q.name)


@njit
def _products(config, activations, stride, levels, out):
    tiles.configure(config)
    tiles.product_signed(activations, 32, stride, levels, 64, out, 128)
    tiles.release()


@njit
def _phases(count, sizes):
    """For each size: where numba put an array of that many float32 values, and where
    ``tiles.lined`` put arrays of ``count`` float32 and uint16 values just after it (each
    address mod 64), and their lengths."""
    out = np.empty((len(sizes), 5), dtype=np.int64)
    for i, size in enumerate(sizes):
        plain = np.empty(size, dtype=np.float32)
        a, b = tiles.lined(count, np.float32), tiles.lined(count, np.uint16)
        out[i] = plain.ctypes.data % 64, a.ctypes.data % 64, len(a), b.ctypes.data % 64, len(b)
    return out


def test_scratch_arrays_start_on_a_cache_line():
    """numba aligns its arrays to 32 bytes only (some of the plain arrays here lie half a line
    off); ``tiles.lined`` puts the first value on a line wherever the allocator lands, and gives
    exactly the values asked for."""
    got = _phases(1000, np.arange(1, 40, dtype=np.int64) * 8)
    assert (got[:, 0] != 0).any()
    assert (got[:, [1, 3]] == 0).all()
    assert (got[:, [2, 4]] == 1000).all()


@needs_tiles
def test_a_tile_product_is_the_exact_integer_product():
    rng = np.random.default_rng(1)
    stride = 96  # 16 rows of activations 96 bytes apart, the unit's 32 from byte 32 of each
    activations = rng.integers(-128, 128, (16, stride), dtype=np.int8)
    # weights from byte 64: 8 rows of 64 bytes, four weights of each of 16 outputs a row
    weights = rng.integers(-128, 128, (8, 64))
    levels = np.concatenate([np.zeros(64, np.uint8), weights.astype(np.int8).view(np.uint8).ravel()])
    out = np.zeros(128 + 16 * 64, dtype=np.uint8)
    _products(tiles.CONFIGURATION, activations.view(np.uint8), stride, levels, out)
    a = activations[:, 32:64].astype(np.int64).reshape(16, 8, 4)  # row, group, weight of the group
    w = weights.astype(np.int64).reshape(8, 16, 4)  # group, output, weight of the group
    expected = np.einsum("rgk,gok->ro", a, w)
    np.testing.assert_array_equal(out[128:].view(np.int32).reshape(16, 16), expected)
    assert not out[:128].any()  # nothing written before the products


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_through_the_tiles_get_the_bits_they_get_alone(qtype):
    """48 rows: three blocks of 16 through the tile unit, then 51 (three blocks and a tail of 3
    by the vector loops); 13 units (a group of 8 and a part group); 37 outputs (the last panel
    part-empty). Each row alone goes through the vector loops."""
    rng = np.random.default_rng(50 + int(qtype))
    n_in = row_width(qtype, 13)
    packed = panels.pack(qtype, random_blocks(qtype, 37, n_in, rng))
    x = rng.standard_normal((51, n_in)).astype(np.float32)
    kernel = GEMM_KERNELS[qtype]

    def product(rows: np.ndarray) -> np.ndarray:
        out = np.full((rows.shape[0], 40), np.nan, dtype=np.float32)
        kernel(packed, *QuantizedActivations(rows).parts, out[:, :37])
        assert np.isnan(out[:, 37:]).all(), "a part-empty panel wrote past the last output"
        return out[:, :37]

    alone = np.concatenate([product(x[r:r + 1]) for r in range(51)])
    np.testing.assert_array_equal(product(x[:48]), alone[:48])
    np.testing.assert_array_equal(product(x), alone)
    np.testing.assert_array_equal(product(x[5:21]), alone[5:21])  # one block that starts elsewhere


@pytest.mark.parametrize("qtype", sorted(FEW_ROWS_KERNELS, key=lambda q: q.name), ids=lambda q: q.name)
def test_the_kernel_without_tiles_for_a_head_gets_the_same_bits(qtype):
    """Matrices where the tile loop does not pay (a head, a few among other types) take their
    type's GEMM without it: 51 rows (three blocks of 16 and a tail) give the numbers the tiled
    GEMM gives."""
    rng = np.random.default_rng(90 + int(qtype))
    n_in = row_width(qtype, 13)
    packed = panels.pack(qtype, random_blocks(qtype, 37, n_in, rng))
    acts = QuantizedActivations(rng.standard_normal((51, n_in)).astype(np.float32))
    tiled = GEMM_KERNELS[qtype](packed, *acts.parts, np.empty((51, 37), dtype=np.float32))
    plain = FEW_ROWS_KERNELS[qtype](packed.view(panels.block_dtype(qtype, rows=True)), *acts.parts,
                                    np.empty((51, 37), dtype=np.float32))
    assert np.isfinite(tiled).all() and np.abs(tiled).max() > 0
    np.testing.assert_array_equal(plain, tiled)


def test_a_model_whose_matrices_go_without_the_tile_loop_gives_the_same_logits(tmp_path):
    """The record type of the panels names the GEMM in the compiled block steps too: a tiny
    Q8_0 qwen3 (whose matrices take the tile loop) gives the same logits, to the bit, with every
    matrix moved to the GEMM without it, over a 39-token prefill and a decode step."""
    from tiny_models import write_tiny_gguf

    from worker.engine import Engine
    from worker.engine.weights import PanelWeight

    path = tmp_path / "qwen3.gguf"
    write_tiny_gguf(path, "qwen3", tensor_type="Q8_0")

    def logits(without_tiles: bool) -> list[np.ndarray]:
        engine = Engine.load(path)
        model = engine.model
        matrices = [w for w in model.held_weights() if isinstance(w, PanelWeight)]
        assert matrices and all(w.panels.dtype.names == ("q8_0",) for w in matrices)
        if without_tiles:
            for weight in matrices:
                weight.without_tiles()
            model.fused = [model.fused_layer(layer) for layer in model.layers]  # the steps take the new view
        cache = engine.new_cache(64)
        return [engine.prefill(cache, list(range(1, 40))), model.forward([(cache, [7])])[0]]

    tiled, plain = logits(False), logits(True)
    for a, b in zip(tiled, plain):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def test_the_tiles_are_a_choice_of_the_machine_the_setting_and_the_cache():
    sources = list(Path(kernels.__file__).parent.glob("*.py"))
    assert cache_directory(sources, "base", tiles=True) != cache_directory(sources, "base")
    env = {**os.environ, "LMSERVE_TILES": "0"}
    probe = "from worker.engine import kernels; print(kernels.use_tiles())"
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["False"]
    features = kernels.target_features()
    if not (features.get("amx-tile") and features.get("amx-int8")):
        assert not kernels.use_tiles()
