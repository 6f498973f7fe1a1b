"""A party that can write to the kvstore cannot change what the model says: through real worker
processes sharing a directory (and a Redis), chunks tampered every way an attacker can are
refused, the reply is the one computed from scratch, and a restarted worker restores nothing
tampered."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run, wait_until

from gateway.worker_client import WorkerClient
from kvstore.chunks import chunk_keys
from kvstore.store import DirectoryStore, RedisStore
from shared.protocol import Finished, Generate, Tokens
from shared.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.faults import TAMPERINGS, forged, tamper  # noqa: E402  (the attacker's moves, one copy)

CHUNK_TOKENS = 64
SPILL_WAIT = 30.0


def prompt_for(seed: int) -> list[int]:
    return np.random.default_rng(100 + seed).integers(100, 40000, 300).tolist()  # four chunks + 44


async def _ask(endpoint: str, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy reply tokens, prompt tokens reused)."""
    client = WorkerClient(endpoint)
    await client.start()
    await client.wait_ready(120)
    tokens: list[int] = []
    try:
        request = Generate(client.new_request_id(), prompt, SamplingParams(temperature=0.0), 8)
        async for message in client.generate(request):
            if isinstance(message, Tokens):
                tokens += message.ids
            elif isinstance(message, Finished):
                return tokens, message.cached_tokens
        raise AssertionError("no FINISHED")
    finally:
        await client.close()


DIRECTORY_CASES = list(TAMPERINGS["directory"])


@pytest.fixture(scope="module")
def shared_directory(start_worker, default_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tampered")
    secret = folder / "kv-secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    flags = ("--kv-cache-dir", str(folder / "kv"), "--kv-chunk", str(CHUNK_TOKENS), "--ctx", "1024",
             "--kv-secret", str(secret))
    writer, reader = start_worker(default_model, *flags), start_worker(default_model, *flags)
    return writer, reader, DirectoryStore(folder / "kv", max_bytes=1 << 30)


def _spilled(store, fingerprint: str, prompt: list[int]) -> list[str]:
    keys = chunk_keys(fingerprint, prompt, CHUNK_TOKENS)
    assert wait_until(lambda: store.present(keys) == len(keys), SPILL_WAIT)
    return keys


@pytest.mark.parametrize("how", DIRECTORY_CASES)
def test_a_tampered_directory_chunk_never_changes_a_reply(shared_directory, how):
    writer, reader, store = shared_directory
    prompt = prompt_for(DIRECTORY_CASES.index(how))
    expected, cached = run(_ask(writer.endpoint, prompt))
    assert cached == 0
    keys = _spilled(store, writer.card().fingerprint, prompt)
    tamper(store, keys, how)
    # another worker (as a restarted one would) restores the genuine first chunk and stops there
    reply, cached = run(_ask(reader.endpoint, prompt))
    assert reply == expected
    assert cached == CHUNK_TOKENS
    # and someone else's conversation sharing the prefix is served from genuine KV too
    other = prompt[:200] + [7, 8, 9]
    reference, _ = run(_ask(writer.endpoint, other))
    assert run(_ask(reader.endpoint, other))[0] == reference


def test_a_restarted_worker_restores_only_genuine_chunks(shared_directory):
    """After the tampering above, the reader wrote back what it recomputed: a restarted worker
    finds every chunk genuine again, and answers as before."""
    writer, reader, store = shared_directory
    fingerprint = writer.card().fingerprint
    expected = {}
    for how in DIRECTORY_CASES:
        prompt = prompt_for(DIRECTORY_CASES.index(how))
        _spilled(store, fingerprint, prompt)
        expected[how] = run(_ask(reader.endpoint, prompt))[0]
    writer.kill()
    writer.start()
    writer.wait_ready()
    for how in DIRECTORY_CASES:
        reply, cached = run(_ask(writer.endpoint, prompt_for(DIRECTORY_CASES.index(how))))
        assert reply == expected[how]
        assert cached == 4 * CHUNK_TOKENS


def test_a_chunk_forged_in_redis_never_changes_a_reply(start_redis, start_worker, default_model):
    redis = start_redis(password="redis-secret-for-tests")
    flags = ("--kv-store", redis.url, "--kv-chunk", str(CHUNK_TOKENS), "--ctx", "1024",
             "--kv-store-password", "redis-secret-for-tests", "--kv-secret", "0123456789abcdef0123456789abcdef")
    first, second = start_worker(default_model, *flags), start_worker(default_model, *flags)
    store = RedisStore(redis.url, password="redis-secret-for-tests")
    prompt = prompt_for(50)
    expected, _ = run(_ask(first.endpoint, prompt))
    keys = _spilled(store, first.card().fingerprint, prompt)
    for key in keys:  # every chunk full of NaN: an empty reply with status 200, before
        store.put(key, *forged(store.get(key), np.nan))
    reply, cached = run(_ask(second.endpoint, prompt))
    assert reply == expected and cached == 0
