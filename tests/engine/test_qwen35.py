"""qwen35's recurrent state in the KV cache: a cache holds its whole length or nothing, a
conversation's next turn continues the state it left (the same tokens as a cold run), and what
the state cannot do yet (spill, cartridges) is refused plainly. Its logits against transformers
are in test_parity.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from shared.protocol import Finished, Generate, Tokens
from shared.sampling_params import SamplingParams
from worker.cartridge import Cartridge, from_document, write
from worker.engine import Engine
from worker.scheduler import Scheduler, SchedulerSettings

TURN = list(range(1000, 1030))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35") / "qwen35.gguf"
    write_tiny_gguf(path, "qwen35", context_length=512)
    return Engine.load(path, kv_type="f32")


def test_a_recurrent_cache_holds_all_or_nothing(engine):
    model = engine.model
    cache = model.new_cache(64)
    assert not cache.rewindable and model.kv_index == {3: 0}  # only the full-attention layer keeps KV
    model.forward([(cache, TURN)])
    assert cache.length == len(TURN) and sorted(cache.recurrent) == [0, 1, 2]
    assert cache.common_prefix(TURN + [5, 6]) == len(TURN)  # a continuation: all of it
    assert cache.common_prefix(TURN[:10] + [5]) == 0  # a shorter or other prompt: nothing
    cache.truncate(len(TURN))
    assert cache.length == len(TURN)  # nothing to cut
    cache.truncate(len(TURN) - 1)
    assert cache.length == 0 and cache.tokens == [] and cache.recurrent == {}
    with pytest.raises(ValueError, match="whole"):
        model.new_cache(64).copy_prefix(_filled(model), 10)


def _filled(model):
    cache = model.new_cache(64)
    model.forward([(cache, TURN)])
    return cache


def test_a_continued_state_is_a_cold_run(engine):
    model = engine.model
    warm = _filled(model)
    copied = model.new_cache(64)
    copied.copy_prefix(warm, warm.length)
    more = [7, 8, 9, 10]
    cold = model.forward([(model.new_cache(64), TURN + more)], all_logits=True)[0][len(TURN):]
    for cache in (warm, copied):
        np.testing.assert_allclose(model.forward([(cache, more)], all_logits=True)[0], cold, atol=1e-4)


def _run(scheduler: Scheduler, outbox: list, rid: str, prompt: list[int]) -> tuple[list[int], Finished]:
    scheduler.submit(b"gw", Generate(rid, prompt, SamplingParams(temperature=0.0), 6, stop_ids=[]))
    for _ in range(100):
        scheduler.admit()
        scheduler.step()
        if not scheduler.running and not scheduler.waiting:
            break
    tokens = [t for m in outbox if isinstance(m, Tokens) and m.request_id == rid for t in m.ids]
    finished = next(m for m in outbox if isinstance(m, Finished) and m.request_id == rid)
    return tokens, finished


def test_a_second_turn_reuses_the_slot_and_says_what_a_cold_run_says(engine):
    outbox: list = []
    scheduler = Scheduler(engine, SchedulerSettings(ctx=256, kv_slots=2), lambda _, m: outbox.append(m))
    first, _ = _run(scheduler, outbox, "turn1", TURN)
    second_prompt = TURN + first + [11, 12, 13]
    second, finished = _run(scheduler, outbox, "turn2", second_prompt)
    # the slot held the first turn's prompt and the reply it fed back (all but the last token)
    assert finished.cached_tokens == len(TURN) + len(first) - 1
    cold_box: list = []
    cold = Scheduler(engine, SchedulerSettings(ctx=256), lambda _, m: cold_box.append(m))
    assert _run(cold, cold_box, "cold", second_prompt)[0] == second
    # a prompt that leaves the held turn is computed from the start, not from a broken state
    other, finished = _run(scheduler, outbox, "other", TURN[:20] + [3, 4])
    assert finished.cached_tokens == 0
    cold_box.clear()
    assert _run(cold, cold_box, "cold-other", TURN[:20] + [3, 4])[0] == other


def test_spill_and_cartridges_are_refused_plainly(engine, tmp_path):
    cache, tokens = from_document(engine, "A short document for the cartridge.", 8)
    write(tmp_path / "doc.safetensors", engine, cache, tokens, "test")
    with pytest.raises(ModelLoadError, match="recurrent state"):
        Cartridge.load(tmp_path / "doc.safetensors", engine)


def test_a_worker_serves_it_with_its_kvstore_off(engine, tmp_path, start_worker, start_gateway):
    worker = start_worker(engine.model.path, "--kv-cache-dir", str(tmp_path / "kv"), "--ctx", "256")
    assert worker.card().capabilities.kvstore is None
    assert "kvstore off: qwen35 keeps recurrent state" in worker.log_path.read_text()
    gateway = start_gateway(worker)
    reply = httpx.post(gateway.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "The lighthouse", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
