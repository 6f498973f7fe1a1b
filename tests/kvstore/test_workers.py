"""KV spill and restore across real worker processes, with a real Redis and a directory."""

from __future__ import annotations

import time

import numpy as np
from conftest import run

from gateway.worker_client import WorkerClient
from shared.protocol import Finished, Generate

PROMPT = np.random.default_rng(11).integers(100, 40000, 300).tolist()  # four 64-token chunks + 44


async def _ask(endpoint: str, prompt: list[int]) -> Finished:
    client = WorkerClient(endpoint)
    await client.start()
    await client.wait_ready(120)
    try:
        request = Generate(client.new_request_id(), prompt, {"temperature": 0.0}, 3)
        async for message in client.generate(request):
            if isinstance(message, Finished):
                return message
        raise AssertionError("no FINISHED")
    finally:
        await client.close()


def _ask_until_cached(endpoint: str, prompt: list[int], minimum: int, tries: int = 20) -> Finished:
    """The spill is written off the decode path: give it a moment to land."""
    finished = run(_ask(endpoint, prompt))
    while finished.cached_tokens < minimum and tries:
        time.sleep(0.3)
        tries -= 1
        finished = run(_ask(endpoint, prompt))
    return finished


def test_a_second_worker_restores_what_the_first_spilled(start_redis, start_worker, default_model):
    redis = start_redis()
    flags = ("--kv-store", redis.url, "--kv-chunk", "64", "--ctx", "1024")
    first, second = start_worker(default_model, *flags), start_worker(default_model, *flags)
    assert run(_ask(first.endpoint, PROMPT)).cached_tokens == 0
    time.sleep(1.0)
    restored = run(_ask(second.endpoint, PROMPT + [5, 6, 7]))
    assert restored.cached_tokens == 256
    assert restored.completion_tokens == 3


def test_a_restarted_worker_restores_from_its_directory(start_worker, default_model, tmp_path):
    worker = start_worker(default_model, "--kv-cache-dir", str(tmp_path / "kv"), "--kv-chunk", "64", "--ctx", "1024")
    assert run(_ask(worker.endpoint, PROMPT)).cached_tokens == 0
    time.sleep(1.0)
    worker.kill()  # not even a clean shutdown: the chunks were written when the request ended
    worker.start()
    worker.wait_ready()
    returning = run(_ask(worker.endpoint, PROMPT[:200] + PROMPT[200:] + [9]))
    assert returning.cached_tokens == 256


def test_redis_killed_mid_run_degrades_to_misses(start_redis, start_worker, default_model):
    redis = start_redis()
    worker = start_worker(default_model, "--kv-store", redis.url, "--kv-chunk", "64", "--ctx", "1024",
                          "--kv-slots", "1")
    assert run(_ask(worker.endpoint, PROMPT)).reason == "length"
    redis.kill()
    other = np.random.default_rng(12).integers(100, 40000, 150).tolist()
    for prompt in (other, PROMPT, other):  # each evicts the single slot; Redis is gone
        finished = run(_ask(worker.endpoint, prompt))
        assert finished.reason == "length"
        assert finished.cached_tokens == 0
    assert worker.proc.poll() is None
