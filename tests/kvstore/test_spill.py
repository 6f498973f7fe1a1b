"""Spill then restore, in-process on the default model: the same logits as recomputing."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvstore.store import DirectoryStore, KVChunk
from shared.protocol import Generate
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.kv_spill import KVSpiller
from worker.scheduler import Scheduler, SchedulerSettings


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
    scratch = model.new_cache(512)
    for cache in (restored, scratch):  # the follow-up is a prompt, as the scheduler marks one
        cache.prompt_end = len(follow_up)
    ours = model.forward([(restored, follow_up[length:])], all_logits=True)[0]
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


def test_a_tenant_restores_only_the_chunks_it_spilled(engine, tmp_path):
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), engine.fingerprint, chunk_tokens=32)
    prompt = list(range(900, 1030))  # 130 tokens: four chunks
    cache = engine.model.new_cache(256)
    engine.prefill(cache, prompt)
    assert spiller.spill(cache, namespace="alice") == 4
    assert spiller.flush()
    assert spiller.restore(engine.model.new_cache(256), prompt, 0, namespace="bob") == 0
    assert spiller.restore(engine.model.new_cache(256), prompt, 0) == 0  # nor the shared namespace
    assert spiller.restore(engine.model.new_cache(256), prompt, 0, namespace="alice") == 128
    spiller.close()


class HeldStore(DirectoryStore):
    """A directory store whose writes wait until the test lets them through."""

    def __init__(self, directory, max_bytes):
        super().__init__(directory, max_bytes)
        self.gate = threading.Event()

    def put(self, key, data, meta):
        self.gate.wait(30)
        super().put(key, data, meta)


def test_a_chunk_waiting_for_the_writer_is_not_copied_again(engine, tmp_path):
    store = HeldStore(tmp_path / "kv", 1 << 30)
    spiller = KVSpiller(store, engine.fingerprint, chunk_tokens=32)
    cache = engine.model.new_cache(256)
    engine.prefill(cache, list(range(700, 830)))  # 130 tokens: four full chunks
    assert spiller.spill(cache) == 4
    assert spiller.spill(cache) == 0  # all four still wait for the writer: not queued twice
    store.gate.set()
    assert spiller.flush()
    assert store.present(spiller.keys_for(cache.tokens)) == 4
    assert spiller.stats.chunks_written == 4
    spiller.close()


def test_a_prompt_is_spilled_chunk_by_chunk_as_it_is_read(engine, tmp_path):
    """Each prompt step queues the chunks it filled, so the copies waiting for the writer stay
    a few chunks even where the whole prompt would not fit the writer's queue."""
    chunk = 32
    store = DirectoryStore(tmp_path / "kv", 1 << 30)
    bytes_per_chunk = chunk * engine.new_cache(1).bytes_per_token
    spiller = KVSpiller(store, engine.fingerprint, chunk, max_pending_bytes=2 * bytes_per_chunk)
    scheduler = Scheduler(engine, SchedulerSettings(ctx=512, prefill_chunk=chunk), lambda *_: None, spiller)
    prompt = np.random.default_rng(5).integers(100, 40000, 8 * chunk + 5).tolist()
    scheduler.submit(b"gw", Generate("long", prompt, SamplingParams(temperature=0.0), 1, stop_ids=[]))
    scheduler.admit()
    keys = spiller.keys_for(prompt)
    for step in range(1, 9):
        scheduler.step()
        assert spiller.flush()  # the writer keeps up with one chunk a step
        assert scheduler.running, "the prompt is still being read"
        assert store.present(keys) == step  # the chunk this step filled is stored already
    while scheduler.running:
        scheduler.step()
    assert spiller.flush()
    assert store.present(keys) == 8
    assert spiller.stats.chunks_dropped == 0  # spilled at the end, six of the eight would not fit
    spiller.close()


class WatchedStore(HeldStore):
    """A held directory store that keeps the buffer each write's data lies in."""

    def __init__(self, directory, max_bytes):
        super().__init__(directory, max_bytes)
        self.buffers = []

    def put(self, key, data, meta):
        self.buffers.append(data.obj if isinstance(data, memoryview) else data)
        super().put(key, data, meta)


def _stored_chunks_are_the_cache_s(store, spiller, cache, chunk):
    k_shape, v_shape = cache.chunk_shapes(chunk)
    for index, key in enumerate(spiller.keys_for(cache.tokens)):
        stored = KVChunk.decode(*store.get(key), k_shape, v_shape, cache.keys[0].dtype.name)
        keys, values = cache.export(index * chunk, chunk)
        np.testing.assert_array_equal(stored.keys, keys)
        np.testing.assert_array_equal(stored.values, values)


def test_a_prompt_s_chunks_are_copied_into_one_buffer_while_the_writer_keeps_up(engine, tmp_path):
    """A fresh copy of a chunk is tens of MiB of new pages (as long in page faults as the copy
    itself): a written chunk's buffer takes the next, and each stored chunk is the cache's."""
    store = WatchedStore(tmp_path / "kv", 1 << 30)
    store.gate.set()
    spiller = KVSpiller(store, engine.fingerprint, chunk_tokens=32)
    cache = engine.model.new_cache(256)
    prompt = np.random.default_rng(8).integers(100, 40000, 128).tolist()
    for at in range(0, 128, 32):
        engine.prefill(cache, prompt[at:at + 32])
        assert spiller.spill(cache) == 1
        assert spiller.flush()
    assert len(store.buffers) == 4 and all(b is store.buffers[0] for b in store.buffers)
    _stored_chunks_are_the_cache_s(store, spiller, cache, 32)
    spiller.close()


def test_chunks_waiting_for_the_writer_each_keep_their_own_copy(engine, tmp_path):
    store = WatchedStore(tmp_path / "kv", 1 << 30)
    spiller = KVSpiller(store, engine.fingerprint, chunk_tokens=32)
    cache = engine.model.new_cache(256)
    engine.prefill(cache, np.random.default_rng(9).integers(100, 40000, 130).tolist())
    assert spiller.spill(cache) == 4  # all four queued before the first is written
    store.gate.set()
    assert spiller.flush()
    assert len({id(buffer) for buffer in store.buffers}) == 4
    _stored_chunks_are_the_cache_s(store, spiller, cache, 32)
    spiller.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_the_writer_runs_only_where_a_core_is_idle(engine, tmp_path):
    """The tag and the write of a chunk take a core for tens of ms: at normal priority they
    took one from the kernels' threads mid-step (a served 2.9k-token prefill read 206-255
    tok/s against 310-333 without spilling)."""
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), engine.fingerprint, chunk_tokens=32)
    cache = engine.model.new_cache(64)
    engine.prefill(cache, list(range(300, 340)))
    assert spiller.spill(cache) == 1 and spiller.flush()  # the writer has run
    assert os.sched_getscheduler(spiller.writer.native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's thread keeps its own
    spiller.close()


@pytest.mark.parametrize("variant", ["gemma4", "gemma4_e"])
def test_layers_of_different_shapes_spill_and_restore(variant, tmp_path):
    """gemma4's sliding and global layers keep KV of different shapes (and gemma4_e's last
    layers none of their own): a restored chunk gives the logits of recomputing all the same."""
    from tiny_models import TINY_FIXTURES, write_tiny_gguf

    arch, overrides = TINY_FIXTURES[variant]
    path = tmp_path / f"{variant}.gguf"
    write_tiny_gguf(path, arch, **overrides)
    engine = Engine.load(str(path))
    model = engine.model
    cache = model.new_cache(128)
    assert not cache.uniform
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), engine.fingerprint, chunk_tokens=16)
    prompt = list(range(300, 350))
    engine.prefill(cache, prompt)
    assert spiller.spill(cache) == 3
    assert spiller.flush()
    restored, scratch = model.new_cache(128), model.new_cache(128)
    follow_up = prompt + [7, 8]
    restored.prompt_end = scratch.prompt_end = len(follow_up)  # a prompt, as the scheduler marks one
    assert spiller.restore(restored, follow_up, resident=0) == 48
    ours = model.forward([(restored, follow_up[48:])], all_logits=True)[0]
    reference = model.forward([(scratch, follow_up)], all_logits=True)[0][48:]
    np.testing.assert_array_equal(ours, reference)
    spiller.close()


def test_a_restored_prompt_lets_its_sliding_layers_go_as_a_computed_one_does(tmp_path):
    """The chunks restored from the store are in it: a served cache's sliding layers give back
    the positions behind their window while the prompt comes back, as they do while one is
    computed, instead of holding every layer's positions until the next spill says so; and the
    prompt goes on as if it had been computed."""
    from tiny_models import write_tiny_gguf

    from worker.engine.archs import load_model
    from worker.engine.gguf_file import GGUFFile
    from worker.engine.kv_cache import RELEASE_STEP

    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3")  # five layers sliding over 4 positions, then a global one
    model = load_model(GGUFFile(path))
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 30), "tiny-gemma3", chunk_tokens=32)
    prompt = np.random.default_rng(6).integers(3, 200, 700).tolist()
    first = model.new_cache(1024)
    first.spilled = 0  # as a served slot's (the scheduler marks it so)
    model.forward([(first, prompt)])
    assert spiller.spill(first) == 21 and spiller.flush()

    follow_up = prompt + [5, 6, 7]
    restored = model.new_cache(1024)
    restored.spilled = 0
    length = spiller.restore(restored, follow_up, resident=0)
    assert length == 672
    assert 0 < length - restored.reach - RELEASE_STEP <= restored.released <= length - restored.reach
    ours = model.forward([(restored, follow_up[length:])], all_logits=True)[0]
    scratch = model.new_cache(1024)
    np.testing.assert_array_equal(ours, model.forward([(scratch, follow_up)], all_logits=True)[0][length:])
    spiller.close()
