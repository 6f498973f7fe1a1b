"""Cartridges (worker/cartridge.py): a KV prefix before every conversation. One made from a
document's first tokens must give a conversation exactly what the document in front of it
gives; a file for another model is refused at start; positions come out of the budget; the
kvstore keys carry the cartridge; the three dialects are served with one."""

from __future__ import annotations

import json

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

DOCUMENT = ("The lighthouse on Varrow Point was built in 1871 by Ada Quint, who painted it green and kept "
            "its lamp for forty years. Ships from Hollin carried her oil across the bay every spring.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cartridge")
    write_tiny_gguf(folder / "qwen3.gguf", "qwen3", context_length=512)
    engine = Engine.load(folder / "qwen3.gguf", kv_type="f32")
    cache, tokens = from_document(engine, DOCUMENT, 24)
    write(folder / "doc.safetensors", engine, cache, tokens, "test document")
    return folder, engine, Cartridge.load(folder / "doc.safetensors", engine)


def test_a_conversation_behind_the_cartridge_is_the_document_then_the_conversation(tiny):
    _, engine, cartridge = tiny
    model = engine.model
    document = engine.tokenizer.encode(DOCUMENT, parse_special=False)[:24]
    question = engine.tokenizer.encode("Who built the lighthouse?", add_special=False)
    whole = model.forward([(model.new_cache(64), document + question)], all_logits=True)[0][24:]
    behind = model.new_cache(64)
    cartridge.put_into(behind)
    assert behind.length == 24 and behind.tokens == cartridge.pseudo_ids
    # f16 in the file: the prefix's keys and values are rounded to halves
    np.testing.assert_allclose(model.forward([(behind, question)], all_logits=True)[0], whole, atol=2e-2)


class Outbox:
    def __init__(self):
        self.messages = []

    def __call__(self, gateway, message):
        self.messages.append(message)


def test_the_scheduler_serves_behind_it_and_reuses_the_prefix(tiny):
    _, engine, cartridge = tiny
    document = engine.tokenizer.encode(DOCUMENT, parse_special=False)[:24]
    prompt = engine.tokenizer.encode("Who built the lighthouse?", add_special=False)

    def run(settings: SchedulerSettings, prompts: list[list[int]]) -> Outbox:
        outbox = Outbox()
        scheduler = Scheduler(engine, settings, outbox)
        for i, ids in enumerate(prompts):
            scheduler.submit(b"gw", Generate(f"r{i}", ids, SamplingParams(temperature=0.0), 6, stop_ids=[]))
            for _ in range(50):
                scheduler.admit()
                scheduler.step()
                if not scheduler.running and not scheduler.waiting:
                    break
        return outbox

    behind = run(SchedulerSettings(ctx=128, cartridge=cartridge), [prompt, prompt + [11]])
    plain = run(SchedulerSettings(ctx=128), [document + prompt])
    tokens = [t for m in behind.messages if isinstance(m, Tokens) and m.request_id == "r0" for t in m.ids]
    assert tokens == [t for m in plain.messages if isinstance(m, Tokens) for t in m.ids]
    finished = {m.request_id: m for m in behind.messages if isinstance(m, Finished)}
    assert finished["r0"].prompt_tokens == len(prompt) and finished["r0"].cached_tokens == 0
    # the second request found the first one's slot: the prefix and the shared prompt reused
    assert finished["r1"].cached_tokens == len(prompt)
    refused = Outbox()
    Scheduler(engine, SchedulerSettings(ctx=40, cartridge=cartridge), refused).submit(
        b"gw", Generate("long", list(range(100, 120)), SamplingParams(), 4))
    assert "of them the cartridge's" in refused.messages[-1].message


def test_a_cartridge_for_another_model_is_refused(tiny, tmp_path):
    folder, _, _ = tiny
    write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    with pytest.raises(ModelLoadError, match="made for a model of family qwen3"):
        Cartridge.load(folder / "doc.safetensors", Engine.load(tmp_path / "llama.gguf"))
    other = tmp_path / "qwen3-other.gguf"
    write_tiny_gguf(other, "qwen3", context_length=512, n_layer=2)
    with pytest.raises(ModelLoadError, match="KV geometry"):
        Cartridge.load(folder / "doc.safetensors", Engine.load(other))
    (tmp_path / "junk.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ModelLoadError, match="not an lmserve cartridge"):
        Cartridge.load(tmp_path / "junk.safetensors", Engine.load(tmp_path / "llama.gguf"))


def test_chunk_keys_carry_the_cartridge(tiny, tmp_path):
    from kvstore.store import DirectoryStore
    from worker.kv_spill import KVSpiller

    _, engine, cartridge = tiny
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 20), engine.fingerprint, chunk_tokens=16)
    ids = cartridge.pseudo_ids + list(range(100, 140))
    plain = spiller.keys_for(ids)
    spiller.prefix_ids = (cartridge.cartridge_id,)
    assert len(plain) == 4 and not set(plain) & set(spiller.keys_for(ids))
    spiller.close()


def test_served_behind_a_cartridge_in_every_dialect(tiny, start_worker, start_gateway):
    folder, _, _ = tiny
    worker = start_worker(folder / "qwen3.gguf", "--cartridge", str(folder / "doc.safetensors"), "--ctx", "256")
    gateway = start_gateway(worker)
    assert worker.card().context_budget == 256 - 24
    assert httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]["cartridges"] == ["doc"]
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}) as streamed:
        assert streamed.headers["x-lmserve-cartridges"] == "doc"
    user = [{"role": "user", "content": "Who built the lighthouse?"}]
    for path, body, usage in (
            ("/v1/chat/completions", {"messages": user, "max_tokens": 4}, "prompt_tokens"),
            ("/v1/responses", {"input": user, "max_output_tokens": 4}, "input_tokens"),
            ("/v1/messages", {"messages": user, "max_tokens": 4}, "input_tokens")):
        reply = httpx.post(gateway.url + path, json={"model": "m", **body}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-lmserve-cartridges"] == "doc"  # which prefix served it
        counted = reply.json()["usage"]
        assert 0 < counted[usage] < 40, json.dumps(counted)  # the conversation's tokens, not the prefix's


def test_the_command_writes_a_cartridge(tiny, tmp_path):
    import subprocess
    import sys

    folder, engine, _ = tiny
    (tmp_path / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "cartridge", "init", str(tmp_path / "doc.txt"),
                           "--tokens", "16", "--out", str(tmp_path / "c.safetensors"),
                           "--model", str(folder / "qwen3.gguf")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "16 positions" in done.stdout
    assert Cartridge.load(tmp_path / "c.safetensors", engine).tokens == 16


def test_prefix_reuse_across_slots_behind_a_cartridge(tiny):
    """Every cache starts with the cartridge: sharing only that is sharing nothing, so a new
    conversation takes the least recently used slot and the others keep theirs."""
    from worker.kv_slots import SlotPool

    _, engine, cartridge = tiny
    pool = SlotPool(engine.model, 3, 128)
    first, second = cartridge.pseudo_ids + list(range(100, 140)), cartridge.pseudo_ids + list(range(200, 240))
    for prompt in (first, second):
        choice = pool.acquire(prompt, floor=cartridge.tokens)
        cartridge.put_into(choice.slot.cache)
        engine.model.forward([(choice.slot.cache, prompt[cartridge.tokens:])])
        pool.release(choice.slot)
    again = pool.acquire(first + [7], floor=cartridge.tokens)
    assert again.reused_tokens == len(first)  # the first conversation's slot, still whole


def test_a_model_that_reads_its_cache_tokens_refuses_a_cartridge(tiny, tmp_path):
    from tiny_nanochat import write_tiny_nanochat

    folder, _, _ = tiny
    write_tiny_nanochat(tmp_path / "nanochat", "native")  # its smear reads the previous token
    engine = Engine.load(str(tmp_path / "nanochat"))
    cache, tokens = from_document(engine, DOCUMENT, 8)
    write(tmp_path / "nano.safetensors", engine, cache, tokens, "test")
    with pytest.raises(ModelLoadError, match="smear"):
        Cartridge.load(tmp_path / "nano.safetensors", engine)
