"""The scheduler in-process on a tiny model: a failing stream ends alone.

Faults are injected into one stream (its sampler, or its KV cache during the weight pass); the
other streams of the same batch must finish exactly as they would have without it.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.protocol import Finished, Generate, Grammar, PromptLogprob, Tokens
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.scheduler import Scheduler, SchedulerSettings


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=1)
    return Engine.load(path)


class Outbox:
    def __init__(self):
        self.messages = []

    def __call__(self, gateway, message):
        self.messages.append(message)

    def finished(self) -> dict[str, Finished]:
        return {m.request_id: m for m in self.messages if isinstance(m, Finished)}

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.messages if isinstance(m, Tokens) and m.request_id == rid for t in m.ids]


def _run(engine, fault=None, batch=3):
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, batch=batch, kv_slots=batch), outbox)
    for i in range(3):
        scheduler.submit(b"gw", Generate(f"r{i}", [5 + i, 17, 300 + i], SamplingParams(temperature=0.0), 12,
                                         stop_ids=[]))
    scheduler.admit()
    if fault:
        fault(scheduler)
    for _ in range(100):
        if not scheduler.running and not scheduler.waiting:
            break
        scheduler.admit()
        scheduler.step()
    return outbox


def test_a_sampler_that_raises_ends_only_its_stream(engine):
    clean = _run(engine)

    def break_sampler(scheduler):
        victim = next(s for s in scheduler.running if s.request.request_id == "r1")

        def explode(logits, allowed=None):
            raise RuntimeError("sampler exploded")
        victim.sampler.sample = explode

    broken = _run(engine, break_sampler)
    finished = broken.finished()
    assert finished["r1"].reason == "error" and "sampler exploded" in finished["r1"].error
    for rid in ("r0", "r2"):
        assert finished[rid].reason == "length"
        assert broken.tokens(rid) == clean.tokens(rid)


def test_a_weight_pass_that_fails_for_one_stream_ends_only_that_stream(engine):
    clean = _run(engine)

    def break_cache(scheduler):
        victim = next(s for s in scheduler.running if s.request.request_id == "r2")
        cache = victim.slot.cache
        calls = {"n": 0}

        def fail_on_third_pass(original):
            def storing(layer, *args):
                calls["n"] += 1
                if calls["n"] > 2 * engine.model.hp.n_layer:
                    raise MemoryError("simulated allocation failure")
                return original(layer, *args)
            return storing
        # a layer reaches its keys once through one of these: the op-by-op path writes them; the
        # compiled steps (a batch's store_and_attend, a lone sequence's block) take the arrays
        cache.write = fail_on_third_pass(cache.write)
        cache.kernel_arrays = fail_on_third_pass(cache.kernel_arrays)

    broken = _run(engine, break_cache)
    finished = broken.finished()
    assert finished["r2"].reason == "error"
    assert len(broken.tokens("r2")) == 2  # it produced tokens until its cache failed
    for rid in ("r0", "r1"):
        assert finished[rid].reason == "length"
        assert broken.tokens(rid) == clean.tokens(rid)


def test_a_prompts_rows_are_marked_and_a_decode_steps_are_not(engine):
    """What the scheduler admits marks its prompt (``KVCache.prompt_end``): prefill chunks are
    a prompt's rows, which attention may take through the tile unit, and the steps after them
    are not, in the same slot on a next turn too."""
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=256, batch=1, kv_slots=1, queue=4, prefill_chunk=8), outbox)
    for rid, prompt in (("first", list(range(3, 23))), ("next", list(range(3, 23)) + [40, 41, 42])):
        scheduler.submit(b"gw", Generate(rid, prompt, SamplingParams(temperature=0.0), 4, stop_ids=[]))
        scheduler.admit()
        [stream] = scheduler.running
        cache = stream.slot.cache
        assert cache.prompt_end == len(prompt)
        seen = []
        while scheduler.running:
            seen.append((cache.length, cache.prompt_rows(1)))
            scheduler.step()
            scheduler.admit()
        assert all(marked == (length < len(prompt)) for length, marked in seen)
        assert any(marked for _, marked in seen) and not seen[-1][1]
    assert outbox.finished()["next"].reason == "length"


def test_abort_of_a_running_stream_frees_its_slot(engine):
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, batch=1, kv_slots=1, queue=4), outbox)
    scheduler.submit(b"gw", Generate("a", [1, 2, 3], SamplingParams(temperature=0.0), 50, stop_ids=[]))
    scheduler.submit(b"gw", Generate("b", [1, 2, 4], SamplingParams(temperature=0.0), 3, stop_ids=[]))
    scheduler.admit()
    scheduler.step()
    scheduler.abort(b"gw", "a")
    for _ in range(20):
        scheduler.admit()
        scheduler.step()
    finished = outbox.finished()
    assert finished["a"].reason == "abort"
    assert finished["b"].reason == "length"
    assert scheduler.pool.free_count() == 1


def test_grammar_streams_and_a_free_stream_share_a_batch(engine):
    """Four grammars and one free stream in one batch: each constrained output obeys its grammar."""
    import json
    import re

    from worker.grammar import GrammarEngine

    outbox = Outbox()
    grammar = GrammarEngine(engine.tokenizer, engine.model.hp.n_vocab)
    scheduler = Scheduler(engine, SchedulerSettings(ctx=256, batch=5, kv_slots=5, queue=8), outbox,
                          grammar=grammar)
    scheduler.wake_io = scheduler.admit_compiled  # in-process: admit right away
    grammars = {
        "json": Grammar("json_schema", json.dumps({
            "type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"], "additionalProperties": False})),
        "regex": Grammar("regex", r"[a-c]{3}-[0-9]{2}"),
        "lark": Grammar("lark", 'start: "yes" | "no" | "maybe"'),
        "enum": Grammar("json_schema", json.dumps({"enum": ["red", "green", 3]})),
    }
    sampling = SamplingParams(temperature=1.0, seed=4)
    for rid, spec in grammars.items():
        scheduler.submit(b"gw", Generate(rid, [5, 17, 300], sampling, 60, grammar=spec))
    scheduler.submit(b"gw", Generate("free", [5, 17, 301], sampling, 10, stop_ids=[]))
    grammar.pool.shutdown(wait=True)  # every compile done, every callback run
    for _ in range(200):
        if not scheduler.running and not scheduler.waiting:
            break
        scheduler.admit()
        scheduler.step()
    finished = outbox.finished()
    text = {rid: engine.tokenizer.decode(outbox.tokens(rid), skip_special=True) for rid in finished}
    assert finished["free"].reason == "length"
    for rid in grammars:
        assert finished[rid].reason == "stop", (rid, finished[rid], text[rid])
    value = json.loads(text["json"])
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool) and set(value) == {"n", "ok"}
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text["regex"])
    assert text["lark"] in ("yes", "no", "maybe")
    assert json.loads(text["enum"]) in ("red", "green", 3)


def test_a_grammar_that_does_not_compile_is_rejected_before_any_token(engine):
    from shared.protocol import Rejected
    from worker.grammar import GrammarEngine

    outbox = Outbox()
    grammar = GrammarEngine(engine.tokenizer, engine.model.hp.n_vocab)
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128), outbox, grammar=grammar)
    scheduler.wake_io = scheduler.admit_compiled
    scheduler.submit(b"gw", Generate("bad", [1, 2], SamplingParams(), 5, grammar=Grammar("lark", "start: nowhere")))
    scheduler.submit(b"gw", Generate("fmt", [1, 2], SamplingParams(), 5,
                                     grammar=Grammar("json_schema", '{"type": "string", "format": "bogus"}')))
    grammar.pool.shutdown(wait=True)
    rejected = {m.request_id: m for m in outbox.messages if isinstance(m, Rejected)}
    assert "nowhere" in rejected["bad"].message and rejected["bad"].status == 400
    assert "bogus" in rejected["fmt"].message
    assert not [m for m in outbox.messages if isinstance(m, Tokens)]


def test_a_matcher_that_fails_mid_stream_ends_only_its_stream(engine):
    """A grammar matcher that refuses a token halfway ends that stream with an error; a free
    stream and another constrained one in the same batch finish as usual."""
    from worker.grammar import GrammarEngine

    outbox = Outbox()
    grammar = GrammarEngine(engine.tokenizer, engine.model.hp.n_vocab)
    scheduler = Scheduler(engine, SchedulerSettings(ctx=256, batch=3, kv_slots=3, queue=4), outbox, grammar=grammar)
    scheduler.wake_io = scheduler.admit_compiled
    spec = Grammar("regex", "[a-z]{40}")
    scheduler.submit(b"gw", Generate("doomed", [5, 17, 300], SamplingParams(temperature=0.0), 60, grammar=spec))
    scheduler.submit(b"gw", Generate("steady", [5, 17, 301], SamplingParams(temperature=0.0), 60, grammar=spec))
    scheduler.submit(b"gw", Generate("free", [5, 17, 302], SamplingParams(temperature=0.0), 6, stop_ids=[]))
    grammar.pool.shutdown(wait=True)
    scheduler.admit()
    doomed = next(s for s in scheduler.running if s.request.request_id == "doomed")
    for step in range(60):
        if not scheduler.running and not scheduler.waiting:
            break
        if step == 2:
            # the matcher breaks (a digit where [a-z] is required): it is now in its error state
            assert doomed in scheduler.running
            assert not doomed.matcher.consume_token(engine.tokenizer.encode("7", add_special=False)[0])
            assert doomed.matcher.is_error()
        scheduler.admit()
        scheduler.step()
    finished = outbox.finished()
    assert finished["doomed"].reason == "error" and "grammar matcher failed" in finished["doomed"].error
    assert 1 <= len(outbox.tokens("doomed")) <= 3
    assert finished["steady"].reason == "stop"
    assert len(engine.tokenizer.decode(outbox.tokens("steady"), skip_special=True)) == 40
    assert finished["free"].reason == "length"


def test_a_scored_prompt_in_chunks_beside_other_streams(engine):
    """prompt_logprobs: the prompt, read in chunks smaller than it while another stream decodes
    in the same steps, is scored as one pass over it scores it; with max_tokens 0 nothing is
    generated, and a cached prefix is not used (every position is computed)."""
    import numpy as np

    from worker.engine.ops import log_softmax

    prompt = [int(t) for t in np.random.default_rng(5).integers(100, 4000, 40)]
    model = engine.model
    rows = log_softmax(model.forward([(model.new_cache(64), prompt)], all_logits=True)[0].astype(np.float64))
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, batch=2, kv_slots=2, prefill_chunk=16), outbox)
    scheduler.submit(b"gw", Generate("warm", prompt[:30], SamplingParams(temperature=0.0), 3, stop_ids=[]))
    for _ in range(20):  # a slot now holds 30 tokens of the prompt to be scored
        scheduler.admit()
        scheduler.step()
    scheduler.submit(b"gw", Generate("other", [7, 8, 9], SamplingParams(temperature=0.0), 8, stop_ids=[]))
    scheduler.submit(b"gw", Generate("scored", prompt, SamplingParams(temperature=0.0), 0, stop_ids=[],
                                     prompt_logprobs=3))
    for _ in range(100):
        if not scheduler.running and not scheduler.waiting:
            break
        scheduler.admit()
        scheduler.step()
    [message] = [m for m in outbox.messages if isinstance(m, Tokens) and m.request_id == "scored"]
    assert message.ids == [] and message.cached_tokens == 0
    scores = message.prompt_logprobs
    assert len(scores) == len(prompt) and scores[0] == PromptLogprob(None, [])
    for i in range(1, len(prompt)):
        logprob, top = scores[i]
        assert logprob == pytest.approx(rows[i - 1][prompt[i]], abs=1e-3)
        assert [t for t, _ in top] == list(np.argsort(-rows[i - 1], kind="stable")[:3])
    finished = outbox.finished()
    assert finished["scored"].reason.value == "length" and finished["scored"].completion_tokens == 0
    assert finished["scored"].cached_tokens == 0
    assert finished["other"].completion_tokens == 8


def test_max_tokens_zero_is_refused_unless_the_prompt_is_scored(engine):
    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128), outbox)
    scheduler.submit(b"gw", Generate("r", [5, 6], SamplingParams(), 0))
    assert "max_tokens must be at least 1" in outbox.messages[-1].message


def test_a_new_conversation_copies_a_shared_prefix_and_leaves_the_other_whole(engine):
    """Two conversations that open alike (one system prompt): the second gets the shared KV
    copied into a slot of its own, and the first one's slot still holds all of it."""
    from worker.kv_slots import FORK_MIN_TOKENS, SlotPool

    pool = SlotPool(engine.model, 2, 512)
    system = [(7 * i) % 500 + 10 for i in range(100)]
    first = system + list(range(600, 600 + FORK_MIN_TOKENS + 20))
    second = system + list(range(900, 950))
    one = pool.acquire(first)
    engine.model.forward([(one.slot.cache, first)])
    pool.release(one.slot)

    two = pool.acquire(second)
    assert two.slot is not one.slot and two.reused_tokens == len(system)
    assert two.slot.cache.tokens == system
    keys, values = two.slot.cache.export(0, len(system))
    held_keys, held_values = one.slot.cache.export(0, len(system))
    assert np.array_equal(keys, held_keys) and np.array_equal(values, held_values)
    assert one.slot.cache.tokens == first  # the first conversation is whole
    engine.model.forward([(two.slot.cache, second[len(system):])])
    pool.release(two.slot)
    # the first conversation's next turn finds all of it again
    assert pool.acquire(first + [5]).reused_tokens == len(first)


def test_the_same_sessions_older_turn_is_cut_back_in_place(engine):
    from worker.kv_slots import FORK_MIN_TOKENS, SlotPool

    pool = SlotPool(engine.model, 2, 512)
    turn = list(range(100, 200))
    reply = list(range(300, 300 + FORK_MIN_TOKENS))  # a reply the next turn renders otherwise
    one = pool.acquire(turn, session="s")
    engine.model.forward([(one.slot.cache, turn + reply)])
    pool.release(one.slot)
    again = pool.acquire(turn + [1, 2, 3], session="s")
    assert again.slot is one.slot and again.reused_tokens == len(turn)


def _conversation(pool, engine, tokens, release=True):
    choice = pool.acquire(tokens)
    engine.model.forward([(choice.slot.cache, tokens[choice.reused_tokens:])])
    if release:
        pool.release(choice.slot)
    return choice.slot


def test_a_long_prompt_drops_the_least_recently_used_idle_caches_past_the_budget(engine):
    """Three idle conversations of 150 tokens and a budget of 512 positions: a new prompt of 300
    drops the two oldest (their storage given back), keeps the newest whole, and the budget never
    cuts a running stream."""
    from worker.kv_slots import SlotPool

    pool = SlotPool(engine.model, 5, 512, budget_tokens=512)
    talks = [[1000 + 200 * n + i for i in range(150)] for n in range(3)]
    slots = [_conversation(pool, engine, talk) for talk in talks]
    assert all(slot.cache.length == 150 and slot.cache.nbytes for slot in slots)
    assert pool.dropped == 0  # 450 positions: within the budget
    long = pool.acquire([7] * 300)
    assert pool.dropped == 2
    assert [slot.cache.length for slot in slots] == [0, 0, 150]
    assert slots[0].cache.nbytes == slots[1].cache.nbytes == 0  # the storage itself is gone
    assert slots[2].cache.tokens == talks[2]
    engine.model.forward([(long.slot.cache, [7] * 300)])
    pool.release(long.slot)
    # a dropped conversation starts afresh and grows again; the kept one is found whole
    assert pool.acquire(talks[2] + [5]).reused_tokens == 150
    again = pool.acquire(talks[0] + [5])
    assert again.reused_tokens == 0
    engine.model.forward([(again.slot.cache, talks[0] + [5])])
    assert again.slot.cache.length == 151
    # running streams are never dropped: both stay busy and whole past the budget
    assert pool.acquire([9] * 400) is not None
    assert again.slot.busy and again.slot.cache.length == 151


def test_without_a_budget_every_idle_cache_stays(engine):
    from worker.kv_slots import SlotPool

    pool = SlotPool(engine.model, 4, 512)
    slots = [_conversation(pool, engine, [1000 + 200 * n + i for i in range(150)]) for n in range(3)]
    _conversation(pool, engine, [7] * 500)
    assert pool.dropped == 0 and [slot.cache.length for slot in slots] == [150, 150, 150]


def test_a_sliding_window_models_next_turn_goes_on_from_its_prompt_however_the_reply_reads(tmp_path):
    """The sliding layers give back old positions as a reply runs on; the next turn, which
    repeats the prompt and renders the reply otherwise, still goes on from the prompt's end in
    the resident slot, with the tokens a cold start gives."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3")  # five layers sliding over 4 positions, then a global one
    engine = Engine.load(path)
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 200, 400)]

    def turn(scheduler, outbox, rid, tokens, n):
        scheduler.submit(b"gw", Generate(rid, tokens, SamplingParams(temperature=0.0), n, stop_ids=[]))
        for _ in range(400):
            if not scheduler.running and not scheduler.waiting:
                break
            scheduler.admit()
            scheduler.step()
        first = next(m for m in outbox.messages if isinstance(m, Tokens) and m.request_id == rid)
        return outbox.tokens(rid), first.cached_tokens

    outbox = Outbox()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=1024, batch=1, kv_slots=1, prefill_chunk=64), outbox)
    reply, cached = turn(scheduler, outbox, "first", prompt, 300)
    assert len(reply) == 300 and cached == 0
    [slot] = scheduler.pool.slots
    assert slot.cache.released > 0  # the reply ran past a window and a release step
    following = prompt + [int(t) + 1 for t in reply[:50]] + [11, 12, 13]  # the reply rendered otherwise
    again, cached = turn(scheduler, outbox, "next", following, 12)
    assert cached == len(prompt)
    cold = Scheduler(engine, SchedulerSettings(ctx=1024, batch=1, kv_slots=1, prefill_chunk=64), Outbox())
    assert again == turn(cold, cold.send, "cold", following, 12)[0]
