"""What an architecture file declares is what the engine computes: per-layer RoPE, sliding
windows, score soft caps and the FFN activation, on the compiled and the step-by-step path
alike. The families here are declared in the test, as a new family file would declare them."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from worker.engine import kernels, ops
from worker.engine.archs.llama import LlamaModel
from worker.engine.gguf_file import GGUFFile
from worker.engine.kv_cache import KVCache
from worker.engine.model import AttentionOptions, ForwardPass, Rope


class WindowedLlama(LlamaModel):
    """Every layer sees only its last 4 positions, with a score soft cap; layer 0 rotates with
    its own base."""

    def attention(self, i: int) -> AttentionOptions:
        return AttentionOptions(scale=1.0 / np.sqrt(self.hp.head_dim), window=4, softcap=5.0)

    def rope(self, i: int) -> Rope:
        rope = super().rope(i)
        return Rope(500.0, rope.dims, adjacent=True) if i == 0 else rope


class GeluLlama(LlamaModel):
    activation = "gelu_tanh"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> GGUFFile:
    path = tmp_path_factory.mktemp("toolkit") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=5)  # 2 layers
    return GGUFFile(path)


def _logits(model, tokens: list[int]) -> np.ndarray:
    return model.forward([(model.new_cache(len(tokens)), tokens)], all_logits=True)[0]


def _stepwise(model):
    model.fused = [None] * len(model.fused)
    return model


TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, 40_000, 24)]


def test_layers_that_rotate_alike_share_a_table(tiny_llama):
    assert len(LlamaModel(tiny_llama).rope_tables) == 1
    model = WindowedLlama(tiny_llama)
    assert len(model.rope_tables) == 2 and model.layer_rope == [0, 1]


def test_a_window_hides_what_lies_beyond_the_receptive_field(tiny_llama):
    """Two layers of window 4: the last position reads positions back to 6 before it, no
    further. Changing the first token leaves the last logits alone with the window and moves
    them without it."""
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    for model in (WindowedLlama(tiny_llama), _stepwise(WindowedLlama(tiny_llama))):
        np.testing.assert_array_equal(_logits(model, TOKENS)[-1], _logits(model, changed)[-1])
        assert np.abs(_logits(model, TOKENS)[3] - _logits(model, changed)[3]).max() > 1e-3
    plain = LlamaModel(tiny_llama)
    assert np.abs(_logits(plain, TOKENS)[-1] - _logits(plain, changed)[-1]).max() > 1e-3


def test_the_compiled_path_follows_the_declarations(tiny_llama):
    compiled = WindowedLlama(tiny_llama)
    if not all(compiled.fused):
        pytest.skip("the compiled block steps need AVX2, FMA and F16C")
    stepwise = _stepwise(WindowedLlama(tiny_llama))
    ours, theirs = _logits(compiled, TOKENS), _logits(stepwise, TOKENS)
    assert np.abs(ours - theirs).max() < 1e-3
    assert np.abs(ours - _logits(LlamaModel(tiny_llama), TOKENS)).max() > 1e-2  # the declarations act
    # two sequences in one pass (the per-sequence attention of a batch) give the same rows
    caches = [compiled.new_cache(32) for _ in range(2)]
    together = compiled.forward([(caches[0], TOKENS), (caches[1], TOKENS[:9])])
    assert np.abs(together[0] - ours[-1]).max() < 1e-3
    assert np.abs(together[1] - ours[8]).max() < 1e-3


def test_the_gelu_family_leaves_the_compiled_silu_ffn(tiny_llama):
    model = GeluLlama(tiny_llama)
    assert all(spec is None or spec.swiglu is None for spec in model.fused)
    gelu, silu = _logits(model, TOKENS), _logits(_stepwise(LlamaModel(tiny_llama)), TOKENS)
    assert np.isfinite(gelu).all() and np.abs(gelu - silu).max() > 1e-2


def test_gelu_tanh_values():
    # 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))) at ±1 and ±3, computed in float64 by hand
    x = np.array([-3.0, -1.0, 0.0, 1.0, 3.0], dtype=np.float32)
    expected = [-0.0036373920817, -0.1588080094, 0.0, 0.8411919906, 2.9963626079]
    np.testing.assert_allclose(ops.gelu_tanh(x), expected, atol=1e-6)


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels need AVX2, FMA and F16C")
@pytest.mark.parametrize("shape", [(1, 2048), (3, 37), (64, 640), (2, 5)])
def test_the_compiled_gelu_gate_matches_the_formula_and_keeps_rows_apart(shape):
    from worker.engine.kernels import rowwise
    rng = np.random.default_rng(sum(shape))
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    g[0, :2] = [-60.0, 60.0]  # far tails: e^(-2|y|) underflows, σ is 0 or 1
    u = rng.standard_normal(shape).astype(np.float32)
    exact = 0.5 * g.astype(np.float64) * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g.astype(np.float64) ** 3)))
    got = rowwise.gelu_tanh_times(g, u, np.empty_like(g))
    np.testing.assert_allclose(got, exact * u, rtol=2e-6, atol=2e-6 * np.abs(u).max())
    # the hand-computed values of the test above, through the kernel
    x = np.array([[-3.0, -1.0, 0.0, 1.0, 3.0, 0.5, -0.5, 2.0, 7.0]], dtype=np.float32)
    np.testing.assert_allclose(rowwise.gelu_tanh_times(x, np.ones_like(x), np.empty_like(x))[0, :5],
                               [-0.0036373920817, -0.1588080094, 0.0, 0.8411919906, 2.9963626079], atol=1e-6)
    # a row alone gets the bits it gets among the others; out may be the gate itself
    for r in range(shape[0]):
        alone = rowwise.gelu_tanh_times(g[r:r + 1].copy(), u[r:r + 1].copy(), np.empty_like(g[r:r + 1]))
        assert (alone == got[r:r + 1]).all()
    in_place = g.copy()
    assert (rowwise.gelu_tanh_times(in_place, u, in_place) == got).all()


@pytest.mark.parametrize("width", [640, 128, 37, 8, 5])
def test_the_compiled_rms_norm_matches_the_formula_at_any_alignment(width):
    from worker.engine.kernels import rowwise
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((6, width)) * 3).astype(np.float32)
    weight = rng.standard_normal(width).astype(np.float32)
    got = rowwise.rms_norm(x, weight, 1e-6, np.empty_like(x))
    wide = x.astype(np.float64)
    np.testing.assert_allclose(got, wide / np.sqrt((wide ** 2).mean(axis=1, keepdims=True) + 1e-6) * weight,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rowwise.rms_norm(x, np.zeros(0, np.float32), 1e-6, np.empty_like(x)),
                               got / weight, rtol=1e-5, atol=1e-5)
    # a row gets the same bits alone, three floats off alignment, and as a strided view
    for r in range(6):
        buffer = np.zeros(width + 3, dtype=np.float32)
        buffer[3:] = x[r]
        alone = rowwise.rms_norm(buffer[3:].reshape(1, width), weight, 1e-6, np.empty((1, width), np.float32))
        assert (alone[0] == got[r]).all()
    strided = np.zeros((6, 2 * width), dtype=np.float32)[:, ::2]
    strided[:] = x
    assert (rowwise.rms_norm(strided, weight, 1e-6, np.empty_like(x)) == got).all()


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels need AVX2, FMA and F16C")
def test_the_gelu_ffn_takes_the_compiled_gate_with_numpys_result():
    from worker.engine.weights import DenseWeight
    rng = np.random.default_rng(3)
    gate, up, down = (DenseWeight(rng.standard_normal(s).astype(np.float32)) for s in ((48, 32), (48, 32), (32, 48)))
    x = rng.standard_normal((5, 32)).astype(np.float32)
    g, u = ops.linear(x, gate), ops.linear(x, up)
    expected = ops.linear(ops.gelu_tanh(g) * u, down)
    np.testing.assert_allclose(ops.gated_ffn(x, gate, up, down, "gelu_tanh"), expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_activation_fails_at_load(tiny_llama):
    class Odd(LlamaModel):
        activation = "relu6"

    with pytest.raises(ModelLoadError, match="relu6"):
        Odd(tiny_llama)


def test_softcap_squashes_into_the_cap_and_a_cap_of_0_leaves_x():
    x = np.array([-100.0, -3.0, -0.5, 0.0, 0.5, 3.0, 100.0], dtype=np.float32)
    expected = 2.0 * np.tanh(x.astype(np.float64) / 2.0)
    np.testing.assert_allclose(ops.softcap(x, 2.0), expected, rtol=1e-6, atol=1e-7)
    assert ops.softcap(x, 2.0).dtype == np.float32 and np.abs(ops.softcap(x, 2.0)).max() <= 2.0
    assert ops.softcap(x, 0.0) is x


# --- attend: every sequence of a pass over its own cache, against plain numpy ----------------

N_HEAD, N_KV = 4, 2  # two query heads read each KV head
HELD, NEW = (0, 3, 9), (4, 1, 7)  # what each sequence's cache holds before the pass, and its new rows


def reference_attention(q, keys, values, first, scale, window=0, softcap=0.0, bias=None, causal=True):
    """q [T, H, d] at positions first.. over keys [L, K, d], values [L, K, dv]: head by head in float64."""
    out = np.zeros((q.shape[0], q.shape[1], values.shape[-1]))
    for t in range(q.shape[0]):
        distance = first + t - np.arange(len(keys))
        for h in range(q.shape[1]):
            kv = h // (q.shape[1] // keys.shape[1])
            scores = keys[:, kv].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            if bias is not None:
                near = (distance >= 0) & (distance < bias.shape[-1])
                scores[near] += bias[t, h, distance[near]]
            if causal:
                scores[(distance < 0) | ((distance >= window) if window else False)] = -np.inf
            weights = np.exp(scores - scores.max())
            out[t, h] = weights / weights.sum() @ values[:, kv].astype(np.float64)
    return out.reshape(q.shape[0], -1)


def _pass(head_dim: int, seed: int = 11):
    """Three sequences holding HELD positions, a pass of NEW rows each: the pass, its q, k, v,
    and each sequence's keys and values before it ([L, K, d])."""
    rng = np.random.default_rng(seed)

    def rows(n: int, heads: int) -> np.ndarray:
        return rng.standard_normal((n, heads, head_dim)).astype(np.float32)

    caches, before = [], []
    for held, new in zip(HELD, NEW):
        cache = KVCache(1, N_KV, head_dim, 32, kv_type="f32")
        k, v = rows(held, N_KV), rows(held, N_KV)
        cache.reserve(held + new)
        cache.write(0, k, v)
        cache.commit([0] * held)
        caches.append(cache)
        before.append((k, v))
    ends = np.cumsum(NEW)
    spans = [(int(end - n), int(end)) for n, end in zip(NEW, ends)]
    positions = np.concatenate([np.arange(held, held + n) for held, n in zip(HELD, NEW)])
    fp = ForwardPass(caches, spans, [], positions)
    total = int(ends[-1])
    return fp, rows(total, N_HEAD), rows(total, N_KV), rows(total, N_KV), before


@pytest.mark.parametrize("head_dim", [6, 16])  # numpy's products; the compiled kernel's sizes
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (4, 0.0), (0, 1.5), (4, 1.5)])
def test_attend_matches_a_plain_reference(head_dim, window, softcap):
    fp, q, k, v, before = _pass(head_dim)
    got = ops.attend(q, k, v, fp, 0, 0.3, window, softcap)
    for cache, (start, end), (held_k, held_v) in zip(fp.caches, fp.spans, before):
        keys, values = np.concatenate([held_k, k[start:end]]), np.concatenate([held_v, v[start:end]])
        np.testing.assert_allclose(got[start:end], reference_attention(q[start:end], keys, values, cache.length,
                                                                       0.3, window, softcap), atol=2e-5)
        # this pass's keys and values are in the cache, after what it held
        np.testing.assert_array_equal(cache.key_rows(0, 0, len(keys)), keys.transpose(1, 0, 2))
    # a layer reading the KV another wrote in this pass sees the same
    np.testing.assert_array_equal(ops.attend(q, None, None, fp, 0, 0.3, window, softcap), got)
    if head_dim == 16 and kernels.available():  # store and attend in one compiled call: the same rows
        np.testing.assert_array_equal(ops.attend(q, k, v, fp, 0, 0.3, window, softcap, compiled=True), got)


@pytest.mark.parametrize("window", [0, 4])
def test_attend_with_a_bias_per_distance(window):
    fp, q, k, v, before = _pass(6, seed=12)
    bias = np.random.default_rng(13).standard_normal((q.shape[0], N_HEAD, 3)).astype(np.float32)
    got = ops.attend(q, k, v, fp, 0, 0.3, window, bias=bias)
    for cache, (start, end), (held_k, held_v) in zip(fp.caches, fp.spans, before):
        keys, values = np.concatenate([held_k, k[start:end]]), np.concatenate([held_v, v[start:end]])
        expected = reference_attention(q[start:end], keys, values, cache.length, 0.3, window, bias=bias[start:end])
        np.testing.assert_allclose(got[start:end], expected, atol=2e-5)
    with pytest.raises(ValueError, match="soft cap"):
        ops.attend(q, k, v, fp, 0, 0.3, window, softcap=1.5, bias=bias)


@pytest.mark.parametrize("window", [0, 4])
def test_attend_on_a_canvas_sees_both_ways_and_writes_nothing(window):
    """A canvas's rows see each other and the cache's positions before them (the last
    window − 1 with a window); the caches are read, not written."""
    fp, q, k, v, before = _pass(6, seed=14)
    fp.canvas = True
    held = [(cache.keys[0].copy(), cache.values[0].copy()) for cache in fp.caches]
    got = ops.attend(q, k, v, fp, 0, 0.3, window)
    for cache, (start, end), (held_k, held_v) in zip(fp.caches, fp.spans, before):
        seen = max(0, cache.length - (window - 1)) if window else 0
        keys = np.concatenate([held_k[seen:], k[start:end]])
        values = np.concatenate([held_v[seen:], v[start:end]])
        expected = reference_attention(q[start:end], keys, values, 0, 0.3, causal=False)
        np.testing.assert_allclose(got[start:end], expected, atol=2e-5)
    for cache, (keys, values) in zip(fp.caches, held):
        np.testing.assert_array_equal(cache.keys[0], keys)
        np.testing.assert_array_equal(cache.values[0], values)


def test_a_tail_of_0_gives_no_logits_and_leaves_the_others_and_the_cache_alone(tiny_llama):
    model = LlamaModel(tiny_llama)
    head, rest = TOKENS[:16], TOKENS[16:]
    both = [model.new_cache(32), model.new_cache(32)]
    first, second = model.forward([(both[0], head), (both[1], head[:5])], tails=[0, 1])
    assert first.shape == (0, model.hp.n_vocab) and second.shape == (model.hp.n_vocab,)
    alone = model.new_cache(32)
    np.testing.assert_array_equal(second, model.forward([(alone, head[:5])])[0])
    # the chunk's KV went in all the same: the rest of the prompt reads the same as in one pass
    whole = model.forward([(model.new_cache(32), TOKENS)])[0]
    np.testing.assert_array_equal(model.forward([(both[0], rest)])[0], whole)
    # nothing but prompt chunks in the pass: no head at all
    (none,) = model.forward([(model.new_cache(32), head)], tails=[0])
    assert none.shape == (0, model.hp.n_vocab)
