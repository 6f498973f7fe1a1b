"""bench.synthetic's writer on a small shape: a qwen35 file in PrismML's Q2_0 blocks (the
Ternary-Bonsai-27B layout, which ``bonsai-27b-cut`` writes at its real widths), or in ggml's
64-value ones, loads with its matrices held in those blocks and decodes finite logits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.synthetic import Q2_0, Q2_0_64, SHAPES, Shape, tensor_plan, write
from worker.engine import Engine
from worker.engine.gguf_file import GGUFFile


@pytest.mark.parametrize("qtype, block", [(Q2_0, 128), (Q2_0_64, 64)])
def test_a_bonsai_shaped_file_in_q2_0_decodes(tmp_path, qtype, block):
    shape = Shape("qwen35", 4, 128, 2, 1, 64, 256, 0, context=512, linear=(4, 2, 32, 4, 32), interval=4,
                  rope_dims=16, untied=True)
    path = write(shape, qtype, tmp_path / "bonsai-small.gguf")
    gguf = GGUFFile(path)
    for name in ("output.weight", "blk.0.attn_qkv.weight", "blk.0.ssm_out.weight", "blk.3.attn_q.weight",
                 "blk.3.ffn_down.weight"):
        info = gguf.tensor_info(name)
        assert (info.type_name, info.q2_0_block) == ("Q2_0", block), name
    assert gguf.tensor_info("token_embd.weight").type_name == "Q8_0"
    assert gguf.tensor_info("blk.0.ssm_conv1d.weight").type_name == "F32"
    engine = Engine.load(path)
    assert not engine.model.dense_fallbacks  # every Q2_0 matrix is multiplied in its blocks
    cache = engine.model.new_cache(64)
    logits = engine.prefill(cache, list(range(100, 120)))
    for _ in range(3):
        logits = engine.model.forward([(cache, [int(np.argmax(logits))])])[0]
    assert np.isfinite(logits).all() and cache.length == 23


def test_the_bonsai_cut_has_the_real_widths():
    plan = {name: (dims, kind) for name, dims, kind in tensor_plan(SHAPES["bonsai-27b-cut"], Q2_0, 248320)}
    assert plan["output.weight"] == ((248320, 5120), Q2_0)
    assert plan["blk.0.attn_qkv.weight"][0] == (2 * 16 * 128 + 48 * 128, 5120)
    assert plan["blk.3.attn_q.weight"][0] == (2 * 24 * 256, 5120)
    assert plan["blk.3.ffn_down.weight"] == ((5120, 17408), Q2_0)
