"""KV spill and restore across real worker processes, with a real Redis and a directory."""

from __future__ import annotations

import numpy as np
from conftest import WorkerProcess, run, wait_until

from gateway.worker_client import WorkerClient
from kvstore.chunks import chunk_keys
from kvstore.store import DirectoryStore, KVStore, RedisStore
from shared.protocol import Finished, Generate
from shared.sampling_params import SamplingParams

CHUNK_TOKENS = 64
PROMPT = np.random.default_rng(11).integers(100, 40000, 300).tolist()  # four 64-token chunks + 44
SPILL_WAIT = 30.0  # seconds; a background thread writes a request's chunks after it ends


def wait_for_spill(store: KVStore, worker: WorkerProcess, prompt: list[int]) -> bool:
    """Whether every full chunk of ``prompt`` lands whole in ``store`` (metadata is written last)."""
    keys = chunk_keys(worker.card().fingerprint, prompt, CHUNK_TOKENS)
    return wait_until(lambda: store.present(keys) == len(keys), SPILL_WAIT)


async def _ask(endpoint: str, prompt: list[int]) -> Finished:
    client = WorkerClient(endpoint)
    await client.start()
    await client.wait_ready(120)
    try:
        request = Generate(client.new_request_id(), prompt, SamplingParams(temperature=0.0), 3)
        async for message in client.generate(request):
            if isinstance(message, Finished):
                return message
        raise AssertionError("no FINISHED")
    finally:
        await client.close()


def test_a_second_worker_restores_what_the_first_spilled(start_redis, start_worker, default_model):
    redis = start_redis()
    flags = ("--kv-store", redis.url, "--kv-chunk", str(CHUNK_TOKENS), "--ctx", "1024")
    first, second = start_worker(default_model, *flags), start_worker(default_model, *flags)
    assert run(_ask(first.endpoint, PROMPT)).cached_tokens == 0
    assert wait_for_spill(RedisStore(redis.url), first, PROMPT)
    restored = run(_ask(second.endpoint, PROMPT + [5, 6, 7]))
    assert restored.cached_tokens == 256
    assert restored.completion_tokens == 3


def test_a_restarted_worker_restores_from_its_directory(start_worker, default_model, tmp_path):
    directory = tmp_path / "kv"
    worker = start_worker(default_model, "--kv-cache-dir", str(directory), "--kv-chunk", str(CHUNK_TOKENS),
                          "--ctx", "1024")
    assert run(_ask(worker.endpoint, PROMPT)).cached_tokens == 0
    assert wait_for_spill(DirectoryStore(directory, max_bytes=1 << 30), worker, PROMPT)
    worker.kill()  # not even a clean shutdown: the chunks were written when the request ended
    worker.start()
    worker.wait_ready()
    returning = run(_ask(worker.endpoint, PROMPT[:200] + PROMPT[200:] + [9]))
    assert returning.cached_tokens == 256


def test_redis_killed_mid_run_degrades_to_misses(start_redis, start_worker, default_model):
    redis = start_redis()
    worker = start_worker(default_model, "--kv-store", redis.url, "--kv-chunk", str(CHUNK_TOKENS), "--ctx", "1024",
                          "--kv-slots", "1")
    assert run(_ask(worker.endpoint, PROMPT)).reason == "length"
    redis.kill()
    other = np.random.default_rng(12).integers(100, 40000, 150).tolist()
    for prompt in (other, PROMPT, other):  # each evicts the single slot; Redis is gone
        finished = run(_ask(worker.endpoint, prompt))
        assert finished.reason == "length"
        assert finished.cached_tokens == 0
    assert worker.proc.poll() is None
