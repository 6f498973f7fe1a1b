"""Spill then restore, in-process on the default model: the same logits as recomputing."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.store import DirectoryStore
from worker.engine.engine import Engine
from worker.kv_spill import KVSpiller


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine.load(default_model)  # the served path: weights in place, an f16 KV cache


def test_restored_kv_gives_the_logits_of_recomputing(engine, tmp_path):
    model = engine.model
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), engine.fingerprint, chunk_tokens=64)
    prompt = np.random.default_rng(1).integers(100, 40000, 300).tolist()
    first = model.new_cache(512)
    engine.prefill(first, prompt)
    assert spiller.spill(first) == 4  # 300 tokens: four full chunks of 64
    assert spiller.flush()

    follow_up = prompt + [42, 1337, 7]
    restored = model.new_cache(512)
    length = spiller.restore(restored, follow_up, resident=0)
    assert length == 256
    ours = model.forward([(restored, follow_up[length:])], all_logits=True)[0]

    scratch = model.new_cache(512)
    reference = model.forward([(scratch, follow_up)], all_logits=True)[0][length:]
    # the restored halves are the computed ones, and a prompt's KV does not depend on how it
    # was chunked: the same bits
    np.testing.assert_array_equal(ours, reference)
    assert spiller.stats.chunks_restored == 4
    spiller.close()


def test_restore_continues_a_resident_prefix_and_leaves_one_token(engine, tmp_path):
    model = engine.model
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), engine.fingerprint, chunk_tokens=32)
    prompt = list(range(500, 628))  # 128 tokens: four chunks
    cache = model.new_cache(256)
    engine.prefill(cache, prompt)
    spiller.spill(cache)
    spiller.flush()
    partial = model.new_cache(256)
    engine.prefill(partial, prompt[:40])  # resident: 40 tokens, mid-chunk
    # the whole prompt is stored, but the last token must still be computed: 3 chunks come back
    assert spiller.restore(partial, prompt, resident=40) == 96
    assert partial.tokens == prompt[:96]
    spiller.close()
