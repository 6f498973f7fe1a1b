"""ops.causal_attention against a plain float64 reference, written out head by head.

The engine's version computes queries in blocks, masks only the keys a block can hide, and
divides after the value product; the reference does none of that. Blocks are forced small
here so that block edges fall inside the prompts.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine import ops


def reference(q, keys, values, first_pos, scale, window=None, softcap=None):
    n_tokens, n_head, _ = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    out = np.zeros((n_tokens, n_head, values.shape[-1]))
    for t in range(n_tokens):
        pos = first_pos + t
        for h in range(n_head):
            k, v = keys[h // group].astype(np.float64), values[h // group].astype(np.float64)
            scores = k @ q[t, h].astype(np.float64) * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            visible = np.arange(len(k)) <= pos
            if window is not None:
                visible &= pos - np.arange(len(k)) < window
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max())
            out[t, h] = weights @ v / weights.sum()
    return out.reshape(n_tokens, -1)


@pytest.mark.parametrize("n_tokens, first_pos, window, softcap", [
    (1, 0, None, None),       # the first token of a prompt
    (1, 40, None, None),      # a decode step
    (7, 0, None, None),       # a whole prompt
    (9, 33, None, None),      # a chunk after a cached prefix
    (9, 33, 5, None),         # a sliding window
    (1, 40, 6, None),         # a decode step under a window
    (6, 10, None, 20.0),      # soft-capped scores
])
def test_blocked_attention_matches_the_reference(monkeypatch, n_tokens, first_pos, window, softcap):
    rng = np.random.default_rng(n_tokens * 100 + first_pos)
    n_kv, group, head_dim, value_dim = 2, 3, 8, 6
    n_keys = first_pos + n_tokens
    capacity = n_keys + 5  # a cache is a prefix of a larger buffer, as in KVCache
    keys = rng.standard_normal((n_kv, capacity, head_dim), dtype=np.float32)[:, :n_keys]
    values = rng.standard_normal((n_kv, capacity, value_dim), dtype=np.float32)[:, :n_keys]
    q = rng.standard_normal((n_tokens, n_kv * group, head_dim), dtype=np.float32)
    # two queries per block: block edges fall inside the chunk
    monkeypatch.setattr(ops, "SCORES_BUDGET", 4 * n_kv * group * n_keys * 2)
    got = ops.causal_attention(q, keys, values, first_pos, 0.35, window, softcap)
    want = reference(q, keys, values, first_pos, 0.35, window, softcap)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
