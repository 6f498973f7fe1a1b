"""The compiled kernels against the ``gguf`` package's dequantizers, type by type.

Two references for each int8 kernel: the exact product of the dequantized weights with the
dequantized int8 activations (the kernel must match it to float rounding: this checks the
block decoding and the integer arithmetic), and the float product with the original
activations (the gap is the activation rounding, bounded per block). Shapes are odd on
purpose: output counts that do not split evenly over threads or tiles of four, batches of 1
to 70 rows (past one 64-row pass), rows of several blocks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from worker.engine import kernels, q2_0
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels import fused
from worker.engine.kernels.activations import QuantizedActivations
from worker.engine.weights import INT8_KERNELS, DenseWeight, MatmulInput, QuantizedWeight, dequantize, row_bytes

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")

ROWS = (1, 3, 4, 5, 9, 70)


def block_size(qtype) -> int:
    return qtype.block if isinstance(qtype, q2_0.Layout) else GGML_QUANT_SIZES[qtype][0]


def row_width(qtype, units: int) -> int:
    """A row of about ``units`` 32-weight units that whole blocks of the type fill."""
    return -(-units * 32 // block_size(qtype)) * block_size(qtype)


def random_blocks(qtype: Q, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Weights of ``qtype``: quantized by the gguf package (or q2_0.py) where it can, else
    random block bytes whose f16 scales are set to small finite values (the other bytes are all
    valid)."""
    values = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    if isinstance(qtype, q2_0.Layout):
        return q2_0.quantize(values, qtype.block)
    try:
        return quants.quantize(values, qtype)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, raw.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d and dmin lead the block
        raw[..., 0:4] = scales
    elif qtype == Q.Q6_K:  # d ends it
        raw[..., 208:210] = scales[..., 0:2]
    return raw.reshape(n_out, -1)


def exact_reference(weights: np.ndarray, qtype: Q, acts: QuantizedActivations) -> np.ndarray:
    """Dequantized weights times dequantized activations, in float64."""
    dense = dequantize(weights, qtype, (weights.shape[0], acts.values.shape[1])).astype(np.float64)
    x = acts.values.astype(np.float64) * np.repeat(acts.scales, 32, axis=1)
    return x @ dense.T


@pytest.mark.parametrize("qtype", sorted(INT8_KERNELS, key=lambda q: q.name), ids=lambda q: q.name)
def test_int8_kernel_matches_the_dequantized_product(qtype):
    rng = np.random.default_rng(int(qtype))
    # eleven 32-weight units (or as many more as whole blocks take): a run of eight (the
    # kernel's unrolled step) and some after it
    n_in = row_width(qtype, 11)
    weights = random_blocks(qtype, 37, n_in, rng)
    weight = QuantizedWeight(qtype, (37, n_in), weights)
    dense = dequantize(weights, qtype, (37, n_in))
    for m in ROWS:
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        inp = MatmulInput(x)
        got = weight.times_transposed(inp)
        exact = exact_reference(weights, qtype, inp.quantized)
        scale = np.abs(exact).max()
        np.testing.assert_allclose(got, exact, atol=2e-5 * scale, rtol=0)
        # against the float activations: the int8 rounding of x, at most half a step per value
        floats = x.astype(np.float64) @ dense.T.astype(np.float64)
        bound = (0.5 * np.repeat(inp.quantized.scales, 32, axis=1)) @ np.abs(dense.T).astype(np.float64)
        assert np.all(np.abs(got - floats) <= bound * 1.001 + 1e-4 * scale), f"{qtype.name}, {m} rows"


@pytest.mark.parametrize("qtype", sorted(INT8_KERNELS, key=lambda q: q.name), ids=lambda q: q.name)
def test_a_row_gets_the_same_bits_in_a_tile_and_alone(qtype):
    """The same activation row five times: four go through the tiled loop, one through the
    single-row loop, and all five results must be equal to the bit (batch invariance rests on
    it; a compiler free to reassociate the sums orders the two loops differently)."""
    rng = np.random.default_rng(100 + int(qtype))
    n_in = row_width(qtype, 33)  # long rows: 33 units of 32 (or as many more as whole blocks take)
    # random block bytes, each below 0x3C so every f16 in them is finite (the gguf package's
    # quantized weights and the small scales of random_blocks hid a difference in Q4_0)
    row = row_bytes(qtype, n_in)
    weight = QuantizedWeight(qtype, (29, n_in), rng.integers(0, 0x3C, (29, row), dtype=np.uint8))
    x = np.repeat(rng.standard_normal((1, n_in)).astype(np.float32), 5, axis=0)
    got = weight.times_transposed(x)
    for r in range(1, 5):
        np.testing.assert_array_equal(got[r], got[0])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_kernel_matches_numpy(qtype):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((70, 136)).astype(np.float32)
    raw = {Q.F32: values, Q.F16: values.astype(np.float16),
           Q.BF16: (values.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
    data = raw.view(np.uint8).reshape(70, -1)
    weight = QuantizedWeight(qtype, (70, 136), data)
    dense = dequantize(data, qtype, (70, 136))
    for m in ROWS:
        x = rng.standard_normal((m, 136)).astype(np.float32)
        np.testing.assert_allclose(weight.times_transposed(x), x @ dense.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [3, 12])  # on the calling thread; in parallel
def test_activation_blocks_round_to_the_nearest_step(m):
    rng = np.random.default_rng(4)
    magnitudes = np.array([1e-3, 1.0, 1e3], np.float32)[np.arange(m) % 3, None]
    x = rng.standard_normal((m, 128)).astype(np.float32) * magnitudes
    x[1, 32:64] = 0.0  # an all-zero block
    x[0, 0:32] = 0.0
    x[0, 0:5] = [0.5, -0.5, 1.5, -2.5, 127.0]  # a step of exactly 1: halves round to even
    acts = QuantizedActivations(x)
    steps = np.repeat(acts.scales, 32, axis=1)
    assert np.abs(acts.values.astype(np.int32)).max() <= 127
    assert np.all(np.abs(acts.values * steps - x) <= 0.5 * steps * 1.0001 + 1e-12)
    assert np.all(acts.values[1, 32:64] == 0) and acts.scales[1, 1] == 0
    np.testing.assert_allclose(acts.sums, acts.scales * acts.values.reshape(m, 4, 32).sum(axis=2), rtol=1e-6)
    # the same levels as numpy's float32 arithmetic, bit for bit
    largest = np.abs(x.reshape(m, 4, 32)).max(axis=2, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127.0) / np.where(largest > 0, largest, 1), np.float32(0.0))
    want = np.rint(x.reshape(m, 4, 32) * inverse.astype(np.float32)).astype(np.int8).reshape(m, 128)
    np.testing.assert_array_equal(acts.values, want)
    assert list(acts.values[0, :5]) == [0, 0, 2, -2, 127]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])  # its own decoder; the gguf package's
def test_embedding_rows_decode_like_the_gguf_package(qtype):
    rng = np.random.default_rng(6)
    data = random_blocks(qtype, 40, 96, rng)
    weight = QuantizedWeight(qtype, (40, 96), data)
    ids = np.array([7, 0, 39, 7])
    np.testing.assert_array_equal(weight.rows(ids), quants.dequantize(data, qtype)[ids])


def test_rows_and_experts_read_the_right_blocks():
    rng = np.random.default_rng(5)
    stack = np.stack([random_blocks(Q.Q4_K, 24, 256, rng) for _ in range(3)])
    weight = QuantizedWeight(Q.Q4_K, (3, 24, 256), stack)
    full = weight.dequantize()
    assert full.shape == (3, 24, 256)
    second = weight.expert(1)
    np.testing.assert_array_equal(second.dequantize(), full[1])
    np.testing.assert_array_equal(second.rows(np.array([5, 0, 5])), full[1][[5, 0, 5]])
    x = rng.standard_normal((2, 256)).astype(np.float32)
    dense = DenseWeight(full).expert(1)
    np.testing.assert_allclose(second.times_transposed(x), dense.times_transposed(x),
                               atol=0.01 * np.abs(dense.times_transposed(x)).max())


def test_weights_are_views_of_the_mapped_file(default_model):
    gguf = GGUFFile(default_model)
    weight = gguf.weight("blk.0.ffn_up.weight")
    assert isinstance(weight, QuantizedWeight) and weight.qtype == Q.Q4_1
    assert not weight.data.flags.owndata and not weight.data.flags.writeable
    info = gguf.tensor_info("blk.0.ffn_up.weight")
    with open(default_model, "rb") as fh:
        fh.seek(gguf.data_offset(info))
        assert fh.read(64) == weight.data.reshape(-1)[:64].tobytes()
    assert isinstance(gguf.weight("blk.0.ffn_up.weight", dense=True), DenseWeight)


def test_a_type_without_kernel_is_held_as_float32_and_named(tmp_path):
    import gguf as gguf_package

    rng = np.random.default_rng(6)
    raw = random_blocks(Q.Q2_K, 8, 256, rng)  # a block type the kernels do not serve
    writer = gguf_package.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=Q.Q2_K)
    writer.add_tensor("v", random_blocks(Q.Q8_0, 8, 64, rng), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = GGUFFile(tmp_path / "q2.gguf")
    fallback = loaded.weight("w")
    assert isinstance(fallback, DenseWeight)
    np.testing.assert_array_equal(fallback.values, quants.dequantize(raw, Q.Q2_K))
    assert isinstance(loaded.weight("v"), QuantizedWeight)
    assert loaded.dense_fallbacks == {"w": "Q2_K"}


def test_silu_times_matches_numpy():
    """silu(g)·u eight lanes at a time and in the scalar tail (77 = 9 × 8 + 5 columns), across
    the signs and out to where e^-a would overflow."""
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((3, 77)) * 10).astype(np.float32)
    g[0, :8] = [0.0, -0.0, 88.0, -90.0, 1e-8, -1e-8, 200.0, -200.0]
    g[1, -5:] = [88.0, -90.0, 0.0, 3.0, -3.0]
    u = rng.standard_normal((3, 77)).astype(np.float32)
    x = g.astype(np.float64)
    want = x / (1 + np.exp(-x)) * u
    got = fused.silu_times(g.copy(), u)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


def test_the_kernel_cache_is_one_directory_per_version_of_every_kernel_source(tmp_path):
    import numba

    from shared.default_model import cache_dir
    from worker.engine.kernels import cache_directory, fused

    simd, blocks = tmp_path / "simd.py", tmp_path / "blocks.py"
    simd.write_text("A = 1\n")
    blocks.write_text("B = 2\n")
    first = cache_directory([simd, blocks], "base")
    assert cache_directory([blocks, simd], "base") == first
    simd.write_text("A = 3\n")  # a file the kernels inline changed: a new place, no stale code
    assert cache_directory([simd, blocks], "base") != first
    assert first.startswith("base" + os.sep)
    # the decorated kernels took that place (numba fixes it at decoration)
    expected_base = os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "kernels")
    assert numba.config.CACHE_DIR.startswith(expected_base + os.sep)
    assert fused.dense_block.stats.cache_path.startswith(numba.config.CACHE_DIR)


@pytest.mark.skipif(not kernels.available(), reason="no compiled kernels on this CPU")
def test_the_delta_rule_kernel_matches_the_recurrence_written_out():
    """Gated DeltaNet's recurrence, token by token per head in float64 (decay, read, the
    correction β(v − read) written into the state, the output read with q), against the kernel."""
    from worker.engine.kernels.recurrent import gated_delta_rule

    rng = np.random.default_rng(7)
    steps, heads, key_size, value_size = 5, 3, 8, 16
    state = rng.standard_normal((heads, key_size, value_size)).astype(np.float32)
    q, k = (rng.standard_normal((steps, heads, key_size)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((steps, heads, value_size)).astype(np.float32)
    decay, beta = (rng.uniform(0.5, 1.0, (steps, heads)).astype(np.float32) for _ in range(2))
    expected_state = state.astype(np.float64)
    expected = np.zeros((steps, heads, value_size))
    for t in range(steps):
        for h in range(heads):
            s = expected_state[h] * decay[t, h]
            read = s.T @ k[t, h]
            s = s + np.outer(k[t, h], beta[t, h] * (v[t, h] - read))
            expected[t, h] = s.T @ q[t, h]
            expected_state[h] = s
    out = gated_delta_rule(state, q, k, v, decay, beta, np.empty((steps, heads, value_size), np.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, expected_state, rtol=1e-4, atol=1e-4)
