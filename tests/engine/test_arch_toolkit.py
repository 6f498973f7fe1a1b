"""What an architecture file declares is what the engine computes: per-layer RoPE, sliding
windows, score soft caps and the FFN activation, on the compiled and the step-by-step path
alike. The families here are declared in the test, as a new family file would declare them."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.archs.llama import LlamaModel
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import AttentionOptions, Rope


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


def test_an_unknown_activation_fails_at_load(tiny_llama):
    class Odd(LlamaModel):
        activation = "relu6"

    with pytest.raises(ModelLoadError, match="relu6"):
        Odd(tiny_llama)
