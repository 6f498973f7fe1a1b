"""diffusion-gemma: the encoder and decoder passes against transformers, the entropy-bound
sampler, and the scheduler writing replies a block at a time (end of turn, max_tokens, the
context, batching, a second turn in its slot, what it refuses)."""

from __future__ import annotations

import numpy as np
import pytest
from test_parity import logit_fixture
from tiny_models import write_tiny_gguf

from shared.protocol import Finished, FinishReason, Generate, Rejected, Tokens
from shared.sampling_params import SamplingParams
from worker.diffusion import CanvasWriter
from worker.engine import Engine
from worker.engine.archs import load_model
from worker.engine.archs.diffusion_gemma import DiffusionSettings
from worker.engine.gguf_file import GGUFFile
from worker.engine.ops import softmax
from worker.scheduler import Scheduler, SchedulerSettings

PROMPT = list(range(100, 130))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion") / "diffusion-gemma.gguf"
    write_tiny_gguf(path, "diffusion-gemma")
    return path


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, kv_type="f32")


def _passes(model, fixture: dict) -> np.ndarray:
    """The fixture's three decoder passes (scripts/regen_transformers_fixtures.py diffusion_passes)."""
    cache = model.new_cache(128)
    model.forward([(cache, fixture["tokens"].tolist())])
    canvas = fixture["canvas"].tolist()
    one = model.denoise([(cache, canvas, None)])[0]
    two = model.denoise([(cache, canvas, softmax(one / np.float32(0.8)))])[0]
    length = cache.length
    model.forward([(cache, fixture["written"].tolist())])
    assert cache.length == length + len(canvas)  # the decoder wrote nothing; the encoder appended
    three = model.denoise([(cache, fixture["canvas2"].tolist(), None)])[0]
    return np.concatenate([one, two, three])


# Measured max |Δlogit| over each row's reference top 20: 2.0e-4 with an f32 cache. An f16
# cache moves the first and third passes by 0.015 and 0.011; the second, conditioned on the
# first's whole distribution, by 0.2 (with the same top 1 everywhere).
@pytest.mark.parametrize("kv_type, tolerance", [("f32", 1e-3), ("f16", 2e-2)])
def test_the_passes_match_transformers(model_path, kv_type, tolerance):
    fixture = logit_fixture("diffusion-gemma_tiny_hf")
    assert fixture["meta"]["model"]["overrides"] == {}, "regenerate the fixture"
    ours = _passes(load_model(GGUFFile(model_path), kv_type=kv_type), fixture)
    np.testing.assert_array_equal(ours.argmax(axis=-1), fixture["top1"])
    error = np.abs(np.take_along_axis(ours, fixture["top_ids"], axis=-1) - fixture["top_logits"]).max(axis=-1)
    canvas = len(fixture["canvas"])
    assert error[:canvas].max() < tolerance and error[2 * canvas:].max() < tolerance
    if kv_type == "f32":
        assert error.max() < tolerance
    # the second pass's argmax is the block the fixture appended
    np.testing.assert_array_equal(ours[canvas:2 * canvas].argmax(axis=-1), fixture["written"])


def test_several_canvases_in_one_pass_are_each_alone(engine):
    model = engine.model
    first, second = model.new_cache(128), model.new_cache(128)
    model.forward([(first, PROMPT)])
    model.forward([(second, PROMPT[:12])])
    probs = softmax(model.denoise([(first, list(range(8)), None)])[0])
    together = model.denoise([(first, list(range(8)), probs), (second, list(range(40, 48)), None)])
    np.testing.assert_allclose(together[0], model.denoise([(first, list(range(8)), probs)])[0], atol=1e-4)
    np.testing.assert_allclose(together[1], model.denoise([(second, list(range(40, 48)), None)])[0], atol=1e-4)


def test_the_expected_embedding_reads_only_the_weighted_rows_of_a_file_table(model_path):
    held = load_model(GGUFFile(model_path))  # the table as the file holds it
    dense = load_model(GGUFFile(model_path), exact=True)  # float32, multiplied whole
    assert type(held.token_embd) is not type(dense.token_embd)
    probs = softmax(np.random.default_rng(4).standard_normal((8, held.hp.n_vocab)).astype(np.float32) * 8)
    probs[:, ::2] = 0.0  # half the vocabulary with no weight at all
    np.testing.assert_allclose(held.soft_embedding(probs), dense.soft_embedding(probs), rtol=1e-4, atol=1e-5)


# --- the sampler ------------------------------------------------------------------------------

def _writer(settings: DiffusionSettings, temperature: float = 0.0, seed: int = 3, n_vocab: int = 5,
            length: int = 4) -> CanvasWriter:
    params = SamplingParams(temperature=temperature, seed=seed)
    return CanvasWriter(settings, n_vocab, length, params, CanvasWriter.rng_for(params))


def test_positions_are_accepted_by_the_entropy_bound():
    settings = DiffusionSettings(max_steps=2, t_min=1.0, t_max=1.0, entropy_bound=0.5, stability_threshold=1)
    writer = _writer(settings)
    # entropies at t = 1: rows 0 and 2 certain (0), row 1 two-way (ln 2 = 0.69), row 3 five-way (1.61)
    big = 60.0
    logits = np.array([[big, 0, 0, 0, 0], [big, big, 0, 0, 0], [0, 0, big, 0, 0], [0, 0, 0, 0, 0]])
    writer.advance(logits)
    # sorted: 0, 0, 0.69, 1.61; the sums before each: 0, 0, 0, 0.69 -> the first three accepted
    assert writer.canvas[0] == 0 and writer.canvas[2] == 2 and writer.canvas[1] in (0, 1)
    assert writer.written() == [0, 0, 2, 0]  # the most likely canvas (ties: the first)
    assert writer.probs.shape == (4, 5) and not writer.done
    writer.advance(logits)
    assert writer.done  # the last pass


def test_a_stable_confident_canvas_ends_early_and_greedy_is_repeatable():
    settings = DiffusionSettings(max_steps=10, entropy_bound=0.1, stability_threshold=1, confidence_threshold=0.01)
    certain = np.full((4, 5), -50.0)
    certain[np.arange(4), [4, 3, 2, 1]] = 50.0
    writer = _writer(settings)
    writer.advance(certain)
    assert not writer.done  # nothing to compare with yet
    writer.advance(certain)
    assert writer.done and writer.passes == 2 and writer.written() == [4, 3, 2, 1]
    assert writer.canvas.tolist() == [4, 3, 2, 1]  # every position accepted
    a, b = _writer(settings, seed=None), _writer(settings, seed=None)  # temperature 0 without a seed: seed 0
    assert a.canvas.tolist() == b.canvas.tolist()


def test_a_sampled_draw_follows_the_distribution():
    settings = DiffusionSettings(max_steps=1, t_min=1.0, t_max=1.0, entropy_bound=1e4)
    writer = _writer(settings, temperature=1.0, seed=11, n_vocab=2, length=4000)
    writer.advance(np.tile(np.log([0.25, 0.75]), (4000, 1)))
    assert 0.72 < writer.canvas.mean() < 0.78  # all accepted (4000 × 0.56 nats < 1e4), drawn at 3:1


def test_the_request_temperature_shapes_the_draw_alone():
    """Self-conditioning, entropies and the early stop follow the model's schedule; only the
    draw feels the request's temperature."""
    settings = DiffusionSettings(max_steps=2, t_min=1.0, t_max=1.0, entropy_bound=0.5)
    logits = np.random.default_rng(2).standard_normal((6, 50)) * 3
    cold, hot = _writer(settings, temperature=0.3, n_vocab=50, length=6), _writer(settings, 1.7, n_vocab=50, length=6)
    cold.advance(logits)
    hot.advance(logits)
    np.testing.assert_allclose(cold.probs, softmax(logits.astype(np.float32)), rtol=1e-5)
    np.testing.assert_array_equal(cold.probs, hot.probs)
    assert cold.written() == hot.written() == logits.argmax(axis=-1).tolist()


def test_settings_that_cannot_run_are_refused_at_load(tmp_path):
    from shared.errors import ModelLoadError

    path = tmp_path / "no-steps.gguf"
    write_tiny_gguf(path, "diffusion-gemma", diffusion={"canvas_length": 8, "eb_max_steps": 0})
    with pytest.raises(ModelLoadError, match="diffusion settings cannot run"):
        load_model(GGUFFile(path))


# --- the scheduler ---------------------------------------------------------------------------

def _run(scheduler: Scheduler, outbox: list, rid: str, prompt: list[int], max_tokens: int,
         **options) -> tuple[list[list[int]], Finished]:
    params = SamplingParams(temperature=options.pop("temperature", 0.0), seed=options.pop("seed", None))
    scheduler.submit(b"gw", Generate(rid, prompt, params, max_tokens, **options))
    for _ in range(200):
        scheduler.admit()
        scheduler.step()
        if not scheduler.running and not scheduler.waiting:
            break
    blocks = [m.ids for m in outbox if isinstance(m, Tokens) and m.request_id == rid]
    finished = next(m for m in outbox if isinstance(m, Finished) and m.request_id == rid)
    return blocks, finished


def _scheduler(engine, outbox: list, **settings) -> Scheduler:
    return Scheduler(engine, SchedulerSettings(**{"ctx": 256, **settings}), lambda _, m: outbox.append(m))


def test_a_reply_is_written_a_block_at_a_time_up_to_max_tokens(engine):
    outbox: list = []
    blocks, finished = _run(_scheduler(engine, outbox), outbox, "r", PROMPT, 20, stop_ids=[])
    assert [len(b) for b in blocks] == [8, 8, 4]  # canvases of 8; the last cut at max_tokens
    assert finished.reason == FinishReason.LENGTH and finished.completion_tokens == 20


def test_a_block_ends_the_reply_at_its_first_end_of_turn_token(engine):
    outbox: list = []
    blocks, _ = _run(_scheduler(engine, outbox), outbox, "free", PROMPT, 16, stop_ids=[])
    second = blocks[1]
    end = second[2]  # a token of the second block: as the end of turn, the reply stops there
    outbox.clear()
    cut, finished = _run(_scheduler(engine, outbox), outbox, "cut", PROMPT, 16, stop_ids=[end])
    first = next((i for i, t in enumerate(blocks[0]) if t == end), None)
    expected = blocks[0][:first + 1] if first is not None else blocks[0] + second[:second.index(end) + 1]
    assert sum(cut, []) == expected and finished.reason == FinishReason.STOP


def test_the_context_bounds_the_canvas(engine):
    outbox: list = []
    blocks, finished = _run(_scheduler(engine, outbox, ctx=len(PROMPT) + 11), outbox, "c", PROMPT, 50,
                            stop_ids=[])
    assert [len(b) for b in blocks] == [8, 3] and finished.reason == FinishReason.CONTEXT


def test_streams_written_together_write_what_they_write_alone(engine):
    alone = {}
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[:10])):
        outbox: list = []
        alone[rid] = _run(_scheduler(engine, outbox), outbox, rid, prompt, 12, stop_ids=[])[0]
    outbox = []
    scheduler = _scheduler(engine, outbox, batch=2)
    scheduler.submit(b"gw", Generate("a", PROMPT, SamplingParams(temperature=0.0), 12, stop_ids=[]))
    blocks_b, _ = _run(scheduler, outbox, "b", PROMPT[:10], 12, stop_ids=[])
    blocks_a = [m.ids for m in outbox if isinstance(m, Tokens) and m.request_id == "a"]
    assert blocks_a == alone["a"] and blocks_b == alone["b"]
    # both were denoised in shared passes: fewer steps than the two alone
    passes_alone = 2 * (1 + 2 * engine.model.settings.max_steps)
    assert scheduler.steps < passes_alone


def test_a_block_whose_writing_fails_ends_only_its_stream(engine, monkeypatch):
    outbox: list = []
    alone, _ = _run(_scheduler(engine, outbox), outbox, "a", PROMPT, 12, stop_ids=[])
    advance = CanvasWriter.advance

    def failing(writer, logits):
        if writer.temperature == 0.7:  # the victim's
            raise FloatingPointError("simulated")
        advance(writer, logits)
    monkeypatch.setattr(CanvasWriter, "advance", failing)
    outbox = []
    scheduler = _scheduler(engine, outbox, batch=2)
    scheduler.submit(b"gw", Generate("victim", PROMPT[:10], SamplingParams(temperature=0.7), 12, stop_ids=[]))
    blocks, finished = _run(scheduler, outbox, "a", PROMPT, 12, stop_ids=[])
    victim = next(m for m in outbox if isinstance(m, Finished) and m.request_id == "victim")
    assert victim.reason == FinishReason.ERROR and "simulated" in victim.error
    assert blocks == alone and finished.reason == FinishReason.LENGTH


def test_a_second_turn_reuses_its_slot(engine):
    outbox: list = []
    scheduler = _scheduler(engine, outbox, kv_slots=2)
    first, _ = _run(scheduler, outbox, "t1", PROMPT, 8, stop_ids=[])
    follow = PROMPT + first[0] + [7, 8, 9]
    second, finished = _run(scheduler, outbox, "t2", follow, 8, stop_ids=[])
    assert finished.cached_tokens == len(PROMPT)  # the prompt was in the slot; the block was never read back
    cold_box: list = []
    assert _run(_scheduler(engine, cold_box), cold_box, "cold", follow, 8, stop_ids=[])[0] == second


def test_a_reasoning_budget_cuts_its_block_at_the_close_and_the_answer_is_the_next_block(engine):
    """Blocks are written whole, so the budget is kept where a block is cut: the reasoning the
    prompt opened ends after its budget's tokens with Gemma 4's close, and the next block follows."""
    from shared.conventions import gemma4
    from worker.reasoning_budget import ReasoningMarkers

    markers = ReasoningMarkers.of(engine.tokenizer, gemma4.GEMMA4)
    assert markers is not None and len(markers.close) == 1
    thinking = PROMPT + list(markers.open)  # the generation prompt opens the thought channel
    outbox: list = []
    free, _ = _run(_scheduler(engine, outbox), outbox, "free", thinking, 16, stop_ids=[])
    assert markers.close[0] not in free[0][:4]  # the model would think on past the budget
    outbox = []
    scheduler = _scheduler(engine, outbox)
    scheduler.decoding.reasoning = markers
    blocks, finished = _run(scheduler, outbox, "budget", thinking, 16, stop_ids=[], reasoning_budget=5)
    # four of its own tokens, then the close in the budget's fifth place; the block ends there
    assert blocks[0] == free[0][:4] + list(markers.close)
    assert len(blocks) >= 2 and sum(map(len, blocks)) == 16
    assert finished.reason == FinishReason.LENGTH and finished.completion_tokens == 16


def test_a_cartridge_is_refused_plainly(engine, tmp_path):
    from shared.errors import ModelLoadError
    from worker.cartridges.cartridge import Cartridge, from_document, write

    cache, tokens = from_document(engine, "A short document for the cartridge.", 8)
    write(tmp_path / "doc.safetensors", engine, cache, tokens, "test")
    with pytest.raises(ModelLoadError, match="text diffusion"):
        Cartridge.load(tmp_path / "doc.safetensors", engine)


@pytest.mark.parametrize("options, named", [
    ({"grammar": {"kind": "regex", "source": "[a-z]+"}}, "constrained output"),
    ({"prompt_logprobs": 2}, "log-probabilities"),
])
def test_what_a_diffusion_model_cannot_do_is_refused_plainly(engine, options, named):
    outbox: list = []
    _scheduler(engine, outbox).submit(b"gw", Generate("x", PROMPT, SamplingParams(), 8, **options))
    rejected = next(m for m in outbox if isinstance(m, Rejected))
    assert rejected.status == 400 and named in rejected.message and "text diffusion" in rejected.message


def test_batched_blocks_stay_alone_whatever_blas_kernels_the_cpu_gets(tmp_path):
    """OpenBLAS picks its kernels by CPU, and some (its Haswell and Zen ones, which a Zen 5 gets)
    sum a row differently by how many rows come with it: a router product through numpy then
    moved a batched stream off its lone tokens. Every product of a pass is compiled here; the
    batching tests run again under those kernels."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "writing_fails or several_canvases or second_turn"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, run.stdout[-3000:]
    assert "3 passed" in run.stdout
