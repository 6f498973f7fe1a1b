"""Recurrent state in the KV cache, of qwen35's linear-attention layers and of inkling's short
convolutions: a cache holds its whole length or nothing, a conversation's next turn continues
the state it left in its slot or restores it from the kvstore (the same tokens as a cold run),
and a cartridge, which holds no state, is refused plainly. Their logits against the references
are in test_parity.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from shared.protocol import Finished, Generate, Tokens
from shared.sampling_params import SamplingParams
from worker.cartridges.cartridge import Cartridge, from_document, write
from worker.engine import Engine
from worker.scheduler import Scheduler, SchedulerSettings

TURN = list(range(1000, 1030))


# each family's layers that keep state, and the number of states each keeps
STATE_LAYERS = {"qwen35": ([0, 1, 2], 2),  # the convolution's inputs and the delta rule's state
                "inkling": ([0, 1, 2, 3], 4)}  # the inputs of its four convolutions


@pytest.fixture(scope="module", params=sorted(STATE_LAYERS))
def engine(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_tiny_gguf(path, request.param, context_length=512)
    return Engine.load(path, kv_type="f32")


def test_a_recurrent_cache_holds_all_or_nothing(engine):
    model = engine.model
    cache = model.new_cache(64)
    assert not cache.rewindable
    if model.architecture == "qwen35":
        assert model.kv_index == {3: 0}  # only the full-attention layer keeps KV
    model.forward([(cache, TURN)])
    layers, states = STATE_LAYERS[model.architecture]
    assert cache.length == len(TURN) and sorted(cache.recurrent) == layers
    assert {len(held) for held in cache.recurrent.values()} == {states}
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


def test_the_same_prompt_again_is_computed_again(engine):
    """A one-token reply leaves its slot holding exactly the prompt; the same prompt again (a
    regenerated answer) must not reuse all but its last token, a state that no longer exists."""
    outbox: list = []
    scheduler = Scheduler(engine, SchedulerSettings(ctx=256, kv_slots=1), lambda _, m: outbox.append(m))
    params = SamplingParams(temperature=0.0)
    scheduler.submit(b"gw", Generate("one", TURN, params, 1, stop_ids=[]))
    for _ in range(20):
        scheduler.admit()
        scheduler.step()
    assert scheduler.pool.slots[0].cache.length == len(TURN)
    again, finished = _run(scheduler, outbox, "again", TURN)
    assert finished.cached_tokens == 0
    cold_box: list = []
    assert _run(Scheduler(engine, SchedulerSettings(ctx=256), lambda _, m: cold_box.append(m)), cold_box,
                "cold", TURN)[0] == again


def test_a_batched_pass_that_fails_for_one_stream_leaves_the_others_states_as_they_were(engine):
    """The pass fails at its last KV layer, after the earlier layers moved every stream's
    recurrent states on; the others are retried alone from the states they had."""
    def run(fault=None) -> list:
        outbox: list = []
        scheduler = Scheduler(engine, SchedulerSettings(ctx=256, batch=3, kv_slots=3), lambda _, m: outbox.append(m))
        for i in range(3):
            scheduler.submit(b"gw", Generate(f"r{i}", TURN[i:], SamplingParams(temperature=0.0), 6, stop_ids=[]))
        scheduler.admit()
        if fault:
            fault(scheduler)
        for _ in range(50):
            if not scheduler.running:
                break
            scheduler.step()
        return outbox

    def tokens(outbox: list, rid: str) -> list[int]:
        return [t for m in outbox if isinstance(m, Tokens) and m.request_id == rid for t in m.ids]

    def break_cache(scheduler):
        cache = next(s for s in scheduler.running if s.request.request_id == "r1").slot.cache
        original, calls = cache.write, {"n": 0}

        def write(layer, *args):
            calls["n"] += 1
            if calls["n"] >= 3 * cache.n_layer:  # from the third pass (the second decode step), its last KV layer on
                raise MemoryError("simulated allocation failure")
            return original(layer, *args)
        cache.write = write

    clean, broken = run(), run(break_cache)
    finished = {m.request_id: m for m in broken if isinstance(m, Finished)}
    assert finished["r1"].reason == "error" and len(tokens(broken, "r1")) == 2
    for rid in ("r0", "r2"):
        assert finished[rid].reason == "length" and tokens(broken, rid) == tokens(clean, rid)


def test_cartridges_are_refused_plainly(engine, tmp_path):
    cache, tokens = from_document(engine, "A short document for the cartridge.", 8)
    write(tmp_path / "doc.safetensors", engine, cache, tokens, "test")
    with pytest.raises(ModelLoadError, match="recurrent state"):
        Cartridge.load(tmp_path / "doc.safetensors", engine)


def test_a_second_turn_is_restored_from_redis_and_says_what_a_cold_run_says(engine, start_redis):
    """The states at every chunk's end go to the kvstore beside the chunk's KV (prefill steps
    stop at chunk ends, a reply's steps pass them one by one); another scheduler, with empty
    slots, restores the second turn from Redis as far as the last chunk with its states."""
    import redis as redis_client

    from kvstore.store import RedisStore
    from worker.kv_spill import KVSpiller

    server = start_redis()

    def scheduler(outbox: list) -> Scheduler:
        spiller = KVSpiller(RedisStore(server.url), engine.fingerprint, chunk_tokens=16)
        return Scheduler(engine, SchedulerSettings(ctx=256, prefill_chunk=24), lambda _, m: outbox.append(m),
                         spiller=spiller)

    first_box: list = []
    first_worker = scheduler(first_box)
    first, _ = _run(first_worker, first_box, "turn1", TURN)
    assert first_worker.spiller.flush()
    # 30 prompt tokens and 5 of the reply fed back: two whole chunks, each with its states
    held = redis_client.Redis.from_url(server.url)
    assert len(held.keys("*-state:data")) == 2 and first_worker.pool.slots[0].cache.snapshots == {}
    second_prompt = TURN + first + [11, 12, 13]
    cold_box: list = []
    cold, _ = _run(Scheduler(engine, SchedulerSettings(ctx=256), lambda _, m: cold_box.append(m)), cold_box, "cold",
                   second_prompt)
    second_box: list = []
    second, finished = _run(scheduler(second_box), second_box, "turn2", second_prompt)
    assert finished.cached_tokens == 32 and second == cold
    # chunks whose states are gone are not restored: the KV alone cannot continue the sequence
    held.delete(*held.keys("*-state:*"))
    third_box: list = []
    third, finished = _run(scheduler(third_box), third_box, "turn2-again", second_prompt)
    assert finished.cached_tokens == 0 and third == cold


def test_a_worker_serves_it_with_its_kvstore_on(engine, tmp_path, start_worker, start_gateway):
    worker = start_worker(engine.model.path, "--kv-cache-dir", str(tmp_path / "kv"), "--ctx", "256")
    assert worker.card().capabilities.kvstore.startswith("directory")
    gateway = start_gateway(worker)
    reply = httpx.post(gateway.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "The lighthouse", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
