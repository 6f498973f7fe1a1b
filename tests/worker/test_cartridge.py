"""Cartridges (worker/cartridges/cartridge.py): a KV prefix before every conversation. One made from a
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
from worker.cartridges.cartridge import Cartridge, from_document, write, write_arrays
from worker.engine import Engine
from worker.engine.kernels import attention
from worker.scheduler import Scheduler, SchedulerSettings

DOCUMENT = ("The lighthouse on Varrow Point was built in 1871 by Ada Quint, who painted it green and kept "
            "its lamp for forty years. Ships from Hollin carried her oil across the bay every spring.")
OTHER = ("The Ostrel mill grinds barley only on Thursdays, when the river runs fastest past the weir, "
         "and its miller sings to the stones.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cartridge")
    write_tiny_gguf(folder / "qwen3.gguf", "qwen3", context_length=512)
    engine = Engine.load(folder / "qwen3.gguf", kv_type="f32")
    cache, tokens = from_document(engine, DOCUMENT, 24)
    write(folder / "doc.safetensors", engine, cache, tokens, "test document")
    cache, tokens = from_document(engine, OTHER, 16)
    write(folder / "other.safetensors", engine, cache, tokens, "another test document")
    return folder, engine, Cartridge.load(folder / "doc.safetensors", engine)


def test_a_conversation_behind_the_cartridge_is_the_document_then_the_conversation(tiny):
    _, engine, cartridge = tiny
    model = engine.model
    document = engine.tokenizer.encode(DOCUMENT, parse_special=False)[:24]
    question = engine.tokenizer.encode("Who built the lighthouse?", add_special=False)
    scratch, behind = model.new_cache(64), model.new_cache(64)
    scratch.prompt_end = behind.prompt_end = 24 + len(question)  # a prompt, as the scheduler marks one
    whole = model.forward([(scratch, document + question)], all_logits=True)[0][24:]
    cartridge.put_into(behind)
    assert behind.length == 24 and behind.tokens == cartridge.pseudo_ids
    # f16 in the file: the prefix's keys and values are rounded to halves (measured 0.005 here);
    # a prompt's attention in the tile unit rounds them to bfloat16 besides, and the two roundings
    # of the prefix differ by up to a bfloat16 step: 0.026, of logits up to 12 (2^-8 of them, 0.047)
    tolerance = 5e-2 if attention.TILED else 2e-2
    np.testing.assert_allclose(model.forward([(behind, question)], all_logits=True)[0], whole, atol=tolerance)


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


def test_composed_cartridges_keep_their_trained_distances(tiny):
    """A composition holds its first part as it is and each later part with its keys turned to
    the positions it takes: a query at position p meets a later part's key j as it met it at
    p − offset when the part stood alone, in every layer's RoPE."""
    from worker.cartridges.cartridge import compose
    from worker.engine import ops

    folder, engine, doc = tiny
    other = Cartridge.load(folder / "other.safetensors", engine)
    both = compose([doc, other], engine)
    assert both.tokens == doc.tokens + other.tokens and both.names == ["doc", "other"]
    assert both.pseudo_ids == doc.pseudo_ids + other.pseudo_ids
    np.testing.assert_array_equal(both.keys[:, :, :doc.tokens], doc.keys)
    np.testing.assert_array_equal(both.values[:, :, doc.tokens:], other.values)
    model, rng = engine.model, np.random.default_rng(0)
    for layer in range(len(model.layers)):
        inv_freq, adjacent = model.rope_tables[model.layer_rope[layer]]
        query = rng.standard_normal((1, 1, model.hp.head_dim)).astype(np.float32)

        def at(position: int) -> np.ndarray:
            return ops.apply_rope(query, *ops.rope_cos_sin(np.array([position]), inv_freq), adjacent)[0, 0]

        p = 50
        moved = both.keys[layer, :, doc.tokens:] @ at(p)
        alone = other.keys[layer] @ at(p - doc.tokens)
        np.testing.assert_allclose(moved, alone, atol=1e-3 * np.abs(alone).max())
        assert np.abs(both.keys[layer, :, doc.tokens:] - other.keys[layer]).max() > 1e-2  # they did turn
    # a scheduler makes a composition once and keeps it
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, cartridge=doc, library=[other]), Outbox())
    assert scheduler.cartridges.composed([doc, other]) is scheduler.cartridges.composed([doc, other])


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


@pytest.mark.parametrize("tensor, poison", [("values.1", np.nan), ("keys.0", np.inf), ("keys.1", -np.inf)])
def test_a_cartridge_holding_nan_or_inf_is_refused_naming_the_tensor(tiny, tmp_path, tensor, poison):
    """Served, such a prefix turns every reply's attention into NaN and the reply comes out empty:
    it is refused at load in one line that names the file and the tensor."""
    _, engine, _ = tiny
    cache, tokens = from_document(engine, DOCUMENT, 8)
    keys = [cache.key_rows(i, 0, tokens) for i in range(cache.n_layer)]
    values = [cache.values[i][:, :tokens].copy() for i in range(cache.n_layer)]
    name, layer = tensor.split(".")
    (keys if name == "keys" else values)[int(layer)][0, 3, 5] = poison
    bad = tmp_path / "poisoned.safetensors"
    write_arrays(bad, engine, keys, values, tokens, "test")
    with pytest.raises(ModelLoadError) as refused:
        Cartridge.load(bad, engine)
    message = refused.value.message
    assert str(bad) in message and f"{tensor} holds NaN or infinite values" in message and "\n" not in message


def test_chunk_keys_carry_the_cartridge(tiny, tmp_path):
    """The same conversation behind two cartridges, or behind none, is three sets of chunks:
    each cartridge's pseudo-ids are its own."""
    from kvstore.store import DirectoryStore
    from worker.kv_spill import KVSpiller

    folder, engine, cartridge = tiny
    other = Cartridge.load(folder / "other.safetensors", engine)
    assert not set(cartridge.pseudo_ids) & set(other.pseudo_ids) and max(cartridge.pseudo_ids) < 0
    spiller = KVSpiller(DirectoryStore(tmp_path / "kv", 1 << 20), engine.fingerprint, chunk_tokens=16)
    conversation = list(range(100, 140))
    keys = [spiller.keys_for(ids) for ids in (cartridge.pseudo_ids + conversation, other.pseudo_ids + conversation,
                                               conversation)]
    assert [len(k) for k in keys] == [4, 3, 2]
    assert not set(keys[0]) & set(keys[1]) and not set(keys[0]) & set(keys[2]) and not set(keys[1]) & set(keys[2])
    spiller.close()


def test_a_request_names_its_cartridge(tiny):
    """Behind a named cartridge a reply is what that document in front of the prompt gives, and
    a slot held under one cartridge is not reused under another."""
    folder, engine, cartridge = tiny
    other = Cartridge.load(folder / "other.safetensors", engine)
    prompt = engine.tokenizer.encode("Which day does it grind?", add_special=False)
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, kv_slots=2, cartridge=cartridge, library=[other]), outbox)

    def ask(rid: str, names: list[str]) -> None:
        scheduler.submit(b"gw", Generate(rid, prompt, SamplingParams(temperature=0.0), 6, stop_ids=[],
                                         cartridge_ids=names))
        for _ in range(50):
            scheduler.admit()
            scheduler.step()
            if not scheduler.running and not scheduler.waiting:
                break

    ask("default", [])
    ask("named", ["other"])
    ask("by-id", [other.cartridge_id])
    ask("unknown", ["nowhere"])
    ask("two", ["doc", "other"])
    ask("twice", ["doc", "doc"])
    accepted = {m.request_id: m for m in outbox.messages if type(m).__name__ == "Accepted"}
    assert accepted["default"].cartridges == ["doc"] and accepted["named"].cartridges == ["other"]
    rejected = {m.request_id: m.message for m in outbox.messages if type(m).__name__ == "Rejected"}
    assert "unknown cartridge 'nowhere'" in rejected["unknown"] and "'doc', 'other'" in rejected["unknown"]
    assert accepted["two"].cartridges == ["doc", "other"]  # composed, in the order named
    assert "named twice" in rejected["twice"]
    finished = {m.request_id: m for m in outbox.messages if isinstance(m, Finished)}
    assert finished["named"].cached_tokens == 0  # the slot of the default cartridge was not reused
    assert finished["by-id"].cached_tokens == len(prompt) - 1
    tokens = {rid: [t for m in outbox.messages if isinstance(m, Tokens) and m.request_id == rid for t in m.ids]
              for rid in ("default", "named")}
    document = engine.tokenizer.encode(OTHER, parse_special=False)[:16]
    plain = engine.model.forward([(engine.model.new_cache(64), document + prompt)])[0]
    assert tokens["named"][0] == int(np.argmax(plain))


def test_served_behind_a_cartridge_in_every_dialect(tiny, start_worker, start_gateway):
    folder, _, _ = tiny
    worker = start_worker(folder / "qwen3.gguf", "--cartridge", str(folder / "doc.safetensors"), "--ctx", "256",
                          "--cartridges", str(folder / "other.safetensors"))
    gateway = start_gateway(worker)
    assert worker.card().context_budget == 256 - 24
    listed = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]
    assert listed["cartridges"] == ["doc", "other"] and listed["default_cartridge"] == "doc"
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
        assert counted["cartridges"] == ["doc"]
        # the request names another one; an unknown name is refused in the dialect's envelope
        named = httpx.post(gateway.url + path, json={"model": "m", **body, "cartridges": ["other"]}, timeout=60)
        assert named.status_code == 200 and named.headers["x-lmserve-cartridges"] == "other"
        assert named.json()["usage"]["cartridges"] == ["other"]
        unknown = httpx.post(gateway.url + path, json={"model": "m", **body, "cartridges": ["nowhere"]}, timeout=60)
        assert unknown.status_code == 400 and "unknown cartridge 'nowhere'" in unknown.text
        error = unknown.json()
        assert error["type"] == "error" if path == "/v1/messages" else "message" in error["error"]
    wrong = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": user, "cartridges": "other"})
    assert wrong.status_code == 400 and "'cartridges'" in wrong.text
    composed = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                          json={"model": "m", "messages": user, "max_tokens": 3, "cartridges": ["other", "doc"]})
    assert composed.status_code == 200 and composed.headers["x-lmserve-cartridges"] == "other,doc"
    assert composed.json()["usage"]["cartridges"] == ["other", "doc"]
    # the SDKs send it through extra_body, streamed too
    import anthropic
    import openai

    chat = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with chat.chat.completions.with_streaming_response.create(
            model="m", messages=user, max_tokens=3, stream=True, stream_options={"include_usage": True},
            extra_body={"cartridges": ["other"]}) as streamed:
        assert streamed.headers["x-lmserve-cartridges"] == "other"
        chunks = list(streamed.parse())
    assert chunks[-1].usage.model_extra["cartridges"] == ["other"]
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    with messages.messages.stream(model="m", max_tokens=3, messages=user, extra_body={"cartridges": ["other"]}) as s:
        final = s.get_final_message()
    assert final.usage.model_extra["cartridges"] == ["other"]


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
