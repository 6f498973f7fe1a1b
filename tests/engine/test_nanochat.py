"""nanochat checkpoint directories against independent implementations: the Hugging Face port
(transformers' NanoChatForCausalLM) for the original model, and nanochat's own gpt.py for one
with every feature of its 2026 code (scripts/regen_nanochat_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_nanochat import write_tiny_nanochat
from tokenizers import Tokenizer as HFTokenizer

from shared.errors import ModelLoadError
from worker.engine import Engine
from worker.engine.ops import log_softmax

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# float32 against float32 (measured: at most 5e-6 apart with an f32 cache); an f16 cache rounds
# every key and value to 11 significant bits
TOLERANCE = {"f32": 1e-3, "f16": 1e-2}


def _fixture(layout: str) -> dict:
    with np.load(FIXTURES / f"logits_nanochat_{layout}.npz") as data:
        return {key: data[key] for key in data.files} | {"meta": json.loads(str(data["meta"]))}


@pytest.fixture(scope="module", params=["hf", "native"])
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp(f"nanochat-{request.param}")
    write_tiny_nanochat(folder, request.param)
    return request.param, str(folder)


@pytest.mark.parametrize("kv_type", sorted(TOLERANCE))
def test_logits_match_the_reference(checkpoint, kv_type):
    layout, folder = checkpoint
    fixture = _fixture(layout)
    model = Engine.load(folder, kv_type=kv_type).model
    tokens = fixture["tokens"].tolist()
    # all at once, then in uneven chunks through the KV cache (the smear reads the cache's last
    # token across them): both must match
    for chunks in ([len(tokens)], [7, 1, 13, 110, len(tokens) - 131]):
        cache, rows, start = model.new_cache(len(tokens)), [], 0
        for size in chunks:
            rows.append(model.forward([(cache, tokens[start:start + size])], all_logits=True)[0])
            start += size
        logits = np.concatenate(rows)
        assert logits.shape[1] == fixture["meta"]["model"]["vocab"]
        ours = np.take_along_axis(logits, fixture["top_ids"], axis=-1)
        assert np.abs(ours - fixture["top_logits"]).max() < TOLERANCE[kv_type], layout
        logprobs = np.take_along_axis(log_softmax(logits.astype(np.float64)), fixture["top_ids"], axis=-1)
        assert np.abs(logprobs - (fixture["top_logits"] - fixture["logsumexp"][:, None])).max() < TOLERANCE[kv_type]
        np.testing.assert_array_equal(logits.argmax(-1), fixture["top1"])


def test_every_feature_moves_the_logits(tmp_path):
    """Each of the native checkpoint's features is read: dropping any changes the logits."""
    fixture = _fixture("native")
    write_tiny_nanochat(tmp_path, "native")
    model = Engine.load(str(tmp_path), exact=True, kv_type="f32").model
    tokens = fixture["tokens"].tolist()

    def top_error() -> float:
        logits = model.forward([(model.new_cache(len(tokens)), tokens)], all_logits=True)[0]
        return float(np.abs(np.take_along_axis(logits, fixture["top_ids"], axis=-1) - fixture["top_logits"]).max())

    assert top_error() < 1e-3
    for attribute in ("resid_lambdas", "backout_lambda", "smear_gate"):
        saved = getattr(model, attribute)
        setattr(model, attribute, np.zeros_like(saved) if attribute != "resid_lambdas" else np.ones_like(saved))
        assert top_error() > 0.01, attribute
        setattr(model, attribute, saved)
    for layer in model.layers:
        layer.pop("value_embd", None)
    assert top_error() > 0.01
    model.layers[:] = Engine.load(str(tmp_path), exact=True, kv_type="f32").model.layers
    model.windows = [0] * len(model.windows)
    model.attention_options = [model.attention(i) for i in range(len(model.windows))]
    assert top_error() > 0.01


def test_bfloat16_weights_are_multiplied_in_place(tmp_path):
    write_tiny_nanochat(tmp_path / "f32", "native")
    write_tiny_nanochat(tmp_path / "bf16", "native", dtype="BF16")
    tokens = list(range(500, 540))
    results = []
    for folder in ("f32", "bf16"):
        model = Engine.load(str(tmp_path / folder)).model
        results.append(model.forward([(model.new_cache(64), tokens)], all_logits=True)[0])
    assert results[0].std() > 1.0 and 0 < np.abs(results[0] - results[1]).max() < 0.5
    assert (results[0].argmax(-1) == results[1].argmax(-1)).mean() > 0.9


def test_the_tokenizer_matches_the_tokenizers_library(checkpoint):
    """tokenizer.json read into lmserve's tokenizer encodes as the tokenizers library does."""
    _, folder = checkpoint
    ours = Engine.load(folder).tokenizer
    theirs = HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    for text in ("Hello, world! It's 2026; 12345 apples.", "  spaced\n\nlines\ttabs", "Café 日本語 🤖",
                 "<|user_start|>What is 2+2?<|user_end|><|assistant_start|><|python_start|>2+2<|python_end|>"):
        assert ours.encode(text, add_special=False) == theirs.encode(text, add_special_tokens=False).ids, text


def test_what_lmserve_will_not_load_is_named(tmp_path):
    write_tiny_nanochat(tmp_path, "native")
    (tmp_path / "tokenizer.json").rename(tmp_path / "elsewhere.json")
    (tmp_path / "tokenizer.pkl").write_bytes(b"\x80\x04.")
    with pytest.raises(ModelLoadError, match="does not unpickle"):
        Engine.load(str(tmp_path))
    (tmp_path / "model.safetensors").rename(tmp_path / "model_000100.pt")
    with pytest.raises(ModelLoadError, match="pickled torch checkpoint"):
        Engine.load(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not found"):
        Engine.load(str(tmp_path / "missing"))


def _with_header(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


@pytest.mark.parametrize("entry, says", [
    ({"dtype": "BF16", "shape": [64, 64], "data_offsets": [0, 16]}, "not the 2 per value"),  # rows past the data
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}, "outside its data"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [8, 0]}, "outside its data"),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "malformed"),
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "malformed"),
    ({"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}, "lmserve reads F32"),
])
def test_a_tensor_entry_that_does_not_fit_its_bytes_is_refused(tmp_path, entry, says):
    """The kernels read a weight's rows by its shape, in place: the shape and the byte range
    must agree, and lie in the file."""
    from worker.engine.checkpoint import SafetensorsFile

    _with_header(tmp_path / "model.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(ModelLoadError, match=says):
        SafetensorsFile(tmp_path / "model.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        SafetensorsFile(tmp_path / "empty.safetensors")
