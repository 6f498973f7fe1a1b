"""The head a slice of the vocabulary at a time (``DecoderModel.head``): a greedy stream's verified
rows take each row's largest logit without a row of the vocabulary's size each. The logits it
keeps are the bits ``logits`` gives, its choices are ``np.argmax``'s (ties, NaN and a logit
bias included), on
every family's tiny model and block type, and on real files whose heads differ (gemma-3-270m's
soft-capped 262k vocabulary, SmolLM2's Q4_1 file)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from tiny_models import TINY_SPECS, load_tiny

from shared.default_model import model_path
from worker.engine import Engine, panels
from worker.engine.model import DecoderModel
from worker.engine.weights import DenseWeight

AUTOREGRESSIVE = sorted(name for name, (arch, _) in TINY_SPECS.items() if arch != "diffusion-gemma")


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of three panels: a tiny vocabulary meets many, the last of them short."""
    monkeypatch.setattr(DecoderModel, "HEAD_SLICE", 3 * panels.PANEL)


def load(tmp_path_factory, name: str) -> Engine:
    return load_tiny(tmp_path_factory.mktemp(name), name, seed=3)


def check_head(model: DecoderModel, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, model.hp.n_embd)) * 3).astype(np.float32)
    full = model.logits(x)
    keep = rng.random(rows) < 0.5
    kept, best = model.head(x, keep)
    assert kept.shape == (int(keep.sum()), full.shape[1])
    assert np.array_equal(kept.view(np.uint32), full[keep].view(np.uint32)), "the same bits"
    assert np.array_equal(best, np.argmax(full, axis=1))
    # a logit bias on the first rows, as the sampler adds it: one lifted entry per slice, one
    # banned row's favourite, an id past the vocabulary (ignored)
    n = full.shape[1]
    ids = np.array([*range(0, n, DecoderModel.HEAD_SLICE), int(best[0]), n + 3], dtype=np.int64)
    values = np.array([*rng.uniform(0, 8, len(ids) - 2), -1e9, 50.0], dtype=np.float32)
    end = max(1, rows // 2)
    biased = full.copy()
    for r in range(end):
        inside = ids < n
        biased[r, ids[inside]] += values[inside]
    kept, best = model.head(x, keep, [(0, end, ids, values)])
    assert np.array_equal(kept.view(np.uint32), full[keep].view(np.uint32)), "kept rows take no bias"
    assert np.array_equal(best, np.argmax(biased, axis=1))
    assert best[0] != np.argmax(full[0])


@pytest.mark.parametrize("name", AUTOREGRESSIVE + ["nanochat"])
def test_every_family_s_head_keeps_the_bits_and_chooses_argmax_s_token(tmp_path_factory, small_slices, name):
    model = load(tmp_path_factory, name).model
    assert model.hp.n_vocab > 2 * DecoderModel.HEAD_SLICE, "several slices"
    for rows in (1, 3, 17):
        check_head(model, rows, seed=rows)


def test_a_tie_between_slices_goes_to_the_first_and_a_nan_wins(tmp_path_factory, small_slices):
    model = load(tmp_path_factory, "llama").model
    values = model.output.dequantize().copy()
    late = values.shape[0] - 2  # in the last slice
    values[late] = values[5]  # entries 5 and ``late`` score alike for every input
    model.output = DenseWeight(values)  # the compiled product: each output's sum on its own
    x = np.zeros((2, model.hp.n_embd), dtype=np.float32)
    x[:, :] = np.sign(values[5])  # a row that favours entry 5 (and its copy) above the rest
    full = model.logits(x)
    assert full[0, 5] == full[0, late] == full[0].max()
    _, best = model.head(x, np.zeros(2, dtype=bool))
    assert list(best) == [5, 5] == list(np.argmax(full, axis=1))
    values[DecoderModel.HEAD_SLICE + 1] = np.nan  # a NaN logit is np.argmax's choice: the first one
    model.output = DenseWeight(values)
    _, best = model.head(x, np.zeros(2, dtype=bool))
    assert list(best) == [DecoderModel.HEAD_SLICE + 1] * 2 == list(np.argmax(model.logits(x), axis=1))


@pytest.mark.parametrize("name", ["gemma-3-270m", "SmolLM2-135M-Instruct"])
def test_real_heads_keep_the_bits_and_hold_a_slice_not_the_rows(name):
    """gemma-3-270m: a 262,144-entry vocabulary, soft-capped, its tied head Q8_0 in panels;
    SmolLM2: a Q4_1 file's head. 68 rows (four streams verifying 16 drafts) hold a few slices'
    products at most, not their logits (68 MiB of gemma's, 13 of SmolLM2's)."""
    model = Engine.load(model_path(name)).model
    check_head(model, 17)
    rows = 68
    x = np.random.default_rng(1).standard_normal((rows, model.hp.n_embd)).astype(np.float32)
    tracemalloc.start()
    try:
        _, best = model.head(x, np.zeros(rows, dtype=bool))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(best, np.argmax(model.logits(x), axis=1))
    part = rows * DecoderModel.HEAD_SLICE * 4  # one slice's products
    assert peak <= 3 * part and peak < rows * model.output.shape[0] * 4 / 2, \
        f"{peak / 2**20:.1f} MiB at the peak, a slice's products {part / 2**20:.1f} MiB"
