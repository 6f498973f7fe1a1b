"""Training a cartridge (training/selfstudy.py, training/trainer.py): the torch mirror
computes the engine's logits, self-study records the teacher as the engine reads it, training
lowers the distillation loss as the served engine measures it, a run resumes from its
checkpoint, and the trained file is served through all three dialects."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

torch = pytest.importorskip("torch")

from shared.errors import ModelLoadError  # noqa: E402
from worker.cartridges.cartridge import Cartridge, from_document  # noqa: E402
from training.trainer import Prefix, TorchDecoder, distillation_loss  # noqa: E402
from worker.engine import Engine  # noqa: E402
from training.selfstudy import SEED_PROMPTS, TOP_K, SelfStudy, chunks  # noqa: E402

DOCUMENT = ("The lighthouse on Varrow Point was built in 1871 by Ada Quint, who painted it green and kept "
            "its lamp for forty years. Ships from Hollin carried her oil across the bay every spring. "
            "The Ostrel mill grinds barley only on Thursdays, when the river runs fastest past the weir, "
            "and its miller sings to the stones.")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    for arch in ("llama", "qwen3"):
        write_tiny_gguf(folder / f"{arch}.gguf", arch, context_length=512)
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_torch_mirror_gives_the_engines_logits(models, arch):
    """With no prefix and behind a document's KV, as the engine (exact weights, f32 cache)
    computes them: llama's adjacent-pair RoPE and GQA, qwen3's Q/K norms, half-split RoPE and
    tied head."""
    engine = Engine.load(models / f"{arch}.gguf", kv_type="f32", exact=True)
    decoder = TorchDecoder(engine.model)
    tokens = list(range(100, 130))
    plain = engine.model.forward([(engine.new_cache(64), tokens)], all_logits=True)[0]
    with torch.no_grad():
        np.testing.assert_allclose(decoder.logits(decoder.hidden([], [], tokens)).numpy(), plain, atol=1e-4)
    cache, n = from_document(engine, DOCUMENT, 20)
    prefix = Prefix([cache.key_rows(i, 0, n) for i in range(cache.n_layer)],
                    [cache.values[i][:, :n] for i in range(cache.n_layer)])
    keys, values = prefix.whole()
    held = engine.new_cache(64)
    held.restore(0, np.stack([k.detach().numpy() for k in keys]), np.stack([v.detach().numpy() for v in values]),
                 [-1 - i for i in range(n)])
    behind = engine.model.forward([(held, tokens)], all_logits=True)[0]
    with torch.no_grad():
        mirrored = decoder.logits(decoder.hidden(keys, values, tokens)).numpy()
    np.testing.assert_allclose(mirrored, behind, atol=1e-4)
    assert np.abs(behind - plain).max() > 1e-2  # the prefix matters
    # only positions 1.. learn: the first stays where the document put it
    assert all(k.shape[1] == n - 1 for k in prefix.keys) and not prefix.frozen_keys[0].requires_grad


def test_other_families_are_refused_with_the_reason(tmp_path):
    write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3")
    with pytest.raises(ModelLoadError, match="llama and qwen3 families: gemma3 departs"):
        TorchDecoder(Engine.load(tmp_path / "gemma3.gguf").model)


def test_self_study_records_the_teacher_with_the_chunk_in_context(models):
    engine = Engine.load(models / "qwen3.gguf", kv_type="f32")
    study = SelfStudy(engine, seed=3, message_tokens=12, answer_tokens=10)
    pieces = chunks(engine, DOCUMENT, 32)
    assert sum(len(p) for p in pieces) == len(engine.tokenizer.encode(DOCUMENT, add_special=False,
                                                                       parse_special=False))
    sample = study.sample(pieces[1], kind="question")
    answer = sample.tokens[sample.prompt_len:]
    assert sample.kind in SEED_PROMPTS and 0 < len(answer) <= 10
    assert sample.top_ids.shape == sample.top_logprobs.shape == (len(answer), TOP_K)
    # the served prompt holds no chunk; the teacher read one: recompute the teacher's
    # distributions from the chunked prompt and the answer, independently of the sampler
    message = sample.tokens[:sample.prompt_len]
    chunk_text = engine.tokenizer.decode(pieces[1])
    assert chunk_text not in engine.tokenizer.decode(message)
    asked = study.with_chunk(chunk_text, sample.message)
    assert message == study.served_prompt(sample.message)
    # as served: the prompt read as a prompt (its attention in the tile unit where there is one),
    # then the answer's tokens as decode steps read them
    cache = engine.new_cache(len(asked) + 16)
    cache.prompt_end = len(asked)
    logits = np.concatenate([engine.model.forward([(cache, asked)])[0][None],
                             engine.model.forward([(cache, answer[:-1])], all_logits=True)[0]])
    logp = log_softmax(logits)
    best = np.argmax(logp, axis=-1)
    np.testing.assert_array_equal(sample.top_ids[:, 0], best)
    np.testing.assert_allclose(sample.top_logprobs[:, 0], logp[np.arange(len(answer)), best], atol=1e-3)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def served_loss(engine: Engine, cartridge: Cartridge, samples) -> float:
    """The distillation loss as the worker's engine computes it behind a cartridge file."""
    losses = []
    for s in samples:
        cache = engine.new_cache(cartridge.tokens + len(s.tokens))
        cartridge.put_into(cache)
        logits = engine.model.forward([(cache, s.tokens[:-1])], all_logits=True)[0]
        logp = log_softmax(logits[s.prompt_len - 1:len(s.tokens) - 1])
        teacher = np.exp(s.top_logprobs - s.top_logprobs.max(-1, keepdims=True))
        teacher /= teacher.sum(-1, keepdims=True)
        losses.append(-(teacher * np.take_along_axis(logp, s.top_ids, 1)).sum(-1).mean())
    return float(np.mean(losses))


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    """`lmserve cartridge train` on the tiny llama, run in two parts: the second resumes."""
    folder = tmp_path_factory.mktemp("trained")
    (folder / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    out = folder / "facts.safetensors"

    def run(steps: int) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "cartridge", "train", str(folder / "doc.txt"),
                               "--out", str(out), "--model", str(models / "llama.gguf"), "--tokens", "16",
                               "--samples", "6", "--steps", str(steps), "--batch", "2", "--chunk-tokens", "32",
                               "--lr", "0.05"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done

    first = run(20)
    second = run(40)
    return folder, out, first, second


def test_training_lowers_the_loss_the_engine_serves(models, trained):
    from training.trainer import CHECKPOINT_FORMAT

    folder, out, first, second = trained
    assert "resuming" in second.stderr and "6 samples written, step 20" in second.stderr
    assert "self-study" not in second.stderr  # the samples came from the checkpoint
    assert re.search(r"trained 40 steps on 6 conversations", second.stdout)
    state = torch.load(folder / "facts.safetensors.ckpt", weights_only=False)
    assert state["format"] == CHECKPOINT_FORMAT and state["step"] == 40 and len(state["losses"]) == 40
    engine = Engine.load(models / "llama.gguf", kv_type="f32")
    from training.selfstudy import Sample

    samples = [Sample.from_dict(d) for d in state["samples"]]
    cartridge = Cartridge.load(out, engine)
    assert cartridge.tokens == 16
    start, _ = from_document(engine, DOCUMENT, 16)
    from worker.cartridges.cartridge import write

    write(folder / "init.safetensors", engine, start, 16, "untrained")
    untrained = Cartridge.load(folder / "init.safetensors", engine)
    before, after = served_loss(engine, untrained, samples), served_loss(engine, cartridge, samples)
    assert after < before - 0.05, (before, after)
    # the torch mirror's loss on the same samples agrees with the engine's
    prefix = Prefix(list(cartridge.keys), list(cartridge.values))
    with torch.no_grad():
        keys, values = prefix.whole()
        mirrored = np.mean([float(distillation_loss(TorchDecoder(engine.model), keys, values, s)) for s in samples])
    assert abs(mirrored - after) < 2e-2


def test_a_checkpoint_of_another_run_is_refused(models, trained):
    folder, out, _, _ = trained
    (folder / "other.txt").write_text("Another document altogether.", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "cartridge", "train", str(folder / "other.txt"),
                           "--out", str(out), "--model", str(models / "llama.gguf"), "--tokens", "16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "checkpoint of another training run" in done.stderr


def test_the_trained_cartridge_is_served_in_every_dialect(models, trained, start_worker, start_gateway):
    import anthropic
    import openai

    _, out, _, _ = trained
    worker = start_worker(models / "llama.gguf", "--cartridge", str(out), "--ctx", "256")
    gateway = start_gateway(worker)
    user = [{"role": "user", "content": "Who built the lighthouse?"}]
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.with_raw_response.create(model="m", messages=user, max_tokens=4)
    assert chat.headers["x-lmserve-cartridges"] == "facts"
    assert chat.parse().usage.model_extra["cartridges"] == ["facts"]
    response = client.responses.create(model="m", input="Who built the lighthouse?", max_output_tokens=4)
    assert response.status in ("incomplete", "completed") and response.usage.model_extra["cartridges"] == ["facts"]
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    with messages.messages.stream(model="m", max_tokens=4, messages=user) as stream:
        message = stream.get_final_message()
    assert message.usage.model_extra["cartridges"] == ["facts"] and message.usage.input_tokens < 40
