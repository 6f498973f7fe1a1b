"""Speculative decoding (worker/speculation.py, worker/decoding.py): drafts verified in one pass
never change a token. Every family's tiny model, and the default model on a prompt it copies,
write the same replies with speculation on and off: greedy and sampled with seeds, alone and in
batches, under grammars, stop tokens and logprobs; and speculation does draft and accept."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import numpy as np
import pytest
from prometheus_client import REGISTRY
from tiny_models import MTP_FIXTURES, TINY_SPECS, write_tiny_gguf
from tiny_models import load_tiny as tiny_engine

from shared.errors import LmserveError
from shared.protocol import Finished, Generate, Grammar, Tokens
from shared.sampling_params import SamplingParams
from worker.engine import Engine, panels
from worker.engine.model import DecoderModel
from worker.engine.sampling import Sampler
from worker.scheduler import Scheduler, SchedulerSettings
from worker.speculation import Blind, MtpDrafter, NgramIndex, SpeculationSettings

SPEC = SpeculationSettings(max_draft=6)
OFF = SpeculationSettings(kinds=())
# families whose replies are written token by token (diffusion-gemma writes blocks)
AUTOREGRESSIVE = sorted(name for name, (arch, _) in TINY_SPECS.items() if arch != "diffusion-gemma")


def test_a_lookup_drafts_what_followed_the_latest_earlier_run():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert index.propose(3) == [4, 5, 9]  # [1, 2, 3] stood before 4 at position 3
    index.extend([7, 1, 2, 3])
    assert index.propose(2) == [7, 1]  # the latest occurrence wins
    assert NgramIndex([1, 2, 3]).propose(4) == []  # nothing to look back on
    assert NgramIndex([5, 6, 5]).propose(4) == []  # runs of one token are too short to trust


class Outbox:
    def __init__(self):
        self.messages = []

    def __call__(self, gateway, message):
        self.messages.append(message)

    def replies(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for m in self.messages:
            if isinstance(m, Tokens):
                out.setdefault(m.request_id, []).extend(m.ids)
        return out

    def logprobs(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for m in self.messages:
            if isinstance(m, Tokens) and m.logprobs is not None:
                out.setdefault(m.request_id, []).extend(zip(m.logprobs, m.top_logprobs or [None] * len(m.ids)))
        return out

    def finished(self) -> dict[str, Finished]:
        return {m.request_id: m for m in self.messages if isinstance(m, Finished)}


def run(engine: Engine, requests: list[Generate], speculation: SpeculationSettings, batch: int = 1,
        grammar=None, spiller=None, **settings) -> Outbox:
    outbox = Outbox()
    settings = SchedulerSettings(**{"ctx": 256, "queue": len(requests), "batch": batch, "kv_slots": batch,
                                    "speculation": speculation, **settings})
    scheduler = Scheduler(engine, settings, outbox, spiller, grammar=grammar)
    for request in requests:
        scheduler.submit(b"gw", request)
    deadline = time.monotonic() + 120
    while len(outbox.finished()) < len(requests) and time.monotonic() < deadline:
        scheduler.admit_compiled()  # a grammar compiles off the thread
        scheduler.admit()
        if scheduler.running:
            scheduler.step()
        else:
            time.sleep(0.01)
    assert len(outbox.finished()) == len(requests), "every request finishes"
    return outbox


def looping_prompts(n_vocab: int, count: int) -> list[list[int]]:
    """Prompts that repeat a run of tokens: what follows a repeat is worth drafting."""
    rng = np.random.default_rng(7)
    prompts = []
    for _ in range(count):
        run_ = [int(t) for t in rng.integers(3, min(n_vocab, 2000), 6)]
        prompts.append(run_ * 4 + run_[:3])
    return prompts


def load_tiny(tmp_path_factory, name: str) -> Engine:
    return tiny_engine(tmp_path_factory.mktemp(name), name)


class Oracle(Blind):
    """A drafter that knows the reply decoding without speculation wrote (``truth``, by prompt)
    and drafts it, wrong in one place every third time from the second: drafts stand, and drafts are refused, on
    any model, however little a tiny one repeats itself."""

    truth: dict[tuple[int, ...], list[int]] = {}

    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.prompt = max((p for p in self.truth if tuple(self.tokens[:len(p)]) == p), key=len)
        self.calls = 0

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def propose(self, limit):
        self.calls += 1
        written = len(self.tokens) - len(self.prompt)
        drafts = list(self.truth[self.prompt][written:written + limit])
        if self.calls % 3 == 2 and drafts:
            drafts[len(drafts) // 2] += 1  # a wrong token: what follows it is refused
        return drafts


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr("worker.speculation.NgramIndex", Oracle)
    Oracle.truth = {}
    return Oracle.truth


def check_lossless(engine, requests, oracle, batches=(1, 3), grammar=None, refused=True):
    """Each request alone without speculation, then all with it, alone and in batches: the
    same replies, with drafts that stood and drafts that did not."""
    plain = {r.request_id: run(engine, [r], OFF, grammar=grammar) for r in requests}
    for r in requests:
        oracle[tuple(r.prompt)] = plain[r.request_id].replies()[r.request_id]
    for batch in batches:
        spec = run(engine, requests, SPEC, batch=batch, grammar=grammar)
        for r in requests:
            assert spec.replies()[r.request_id] == plain[r.request_id].replies()[r.request_id], f"batch {batch}"
            assert spec.logprobs().get(r.request_id) == plain[r.request_id].logprobs().get(r.request_id)
            assert spec.finished()[r.request_id].reason == plain[r.request_id].finished()[r.request_id].reason
        finished = spec.finished().values()
        drafted, accepted = sum(f.drafted_tokens for f in finished), sum(f.accepted_tokens for f in finished)
        assert 0 < accepted and (accepted < drafted or not refused), "drafts stood and drafts were refused"
    return plain


@pytest.mark.parametrize("name", AUTOREGRESSIVE + ["nanochat"])
def test_every_family_writes_the_same_greedy_replies_with_and_without_speculation(tmp_path_factory, oracle, name,
                                                                                  monkeypatch):
    """Greedy streams verify their drafts by each row's largest logit, a logit bias added, the
    head a slice of the vocabulary at a time (``DecoderModel.head``; slices of three panels
    here, so a tiny vocabulary meets several): the replies are the ones decoding without drafts
    writes."""
    monkeypatch.setattr(DecoderModel, "HEAD_SLICE", 3 * panels.PANEL)
    taken = Counter()
    take = Sampler.take
    monkeypatch.setattr(Sampler, "take", lambda self, token: taken.update([1]) or take(self, token))
    engine = load_tiny(tmp_path_factory, name)
    n_vocab = engine.model.hp.n_vocab
    prompts = looping_prompts(n_vocab, 3)
    # the second stream's bias lifts an entry of the last slice and bans two (one in the first)
    biases = [{}, {n_vocab - 2: 3.0, 1: -100.0, n_vocab // 2: -100.0, n_vocab + 5: 9.0}, {}]
    check_lossless(engine, [Generate(f"r{i}", p, SamplingParams(temperature=0.0, logit_bias=bias), 30, stop_ids=[])
                            for i, (p, bias) in enumerate(zip(prompts, biases))], oracle)
    assert taken[1] > 0, "verified rows came back as choices, not logits"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Engine:
    return load_tiny(tmp_path_factory, "llama")


def test_sampled_replies_are_the_same_for_every_seed(tiny, oracle):
    """At temperature > 0 one random draw is spent per token emitted, in order: a seed names the
    same reply with speculation and without."""
    prompt = looping_prompts(tiny.model.hp.n_vocab, 1)[0]
    for seed in range(4):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, logprobs=True, top_logprobs=2)
        check_lossless(tiny, [Generate("s", prompt, params, 30, stop_ids=[])], oracle, batches=(1,))


def test_the_distribution_of_sampled_tokens_is_the_model_s_own(tiny):
    """Unseeded, over many replies: the frequencies of the tokens at every position agree with
    speculation and without (a chi-square test at the 0.1% level; 3 degrees of freedom for
    every position's commonest tokens and the rest)."""
    prompt = looping_prompts(tiny.model.hp.n_vocab, 1)[0]
    params = SamplingParams(temperature=1.2)
    counts = {}
    for label, settings in (("spec", SPEC), ("off", OFF)):
        requests = [Generate(f"q{i}", prompt, params, 6, stop_ids=[]) for i in range(150)]
        replies = run(tiny, requests, settings, batch=4).replies()
        counts[label] = [Counter(reply[k] for reply in replies.values()) for k in range(6)]
    for position, (spec, off) in enumerate(zip(counts["spec"], counts["off"])):
        common = [token for token, _ in (spec + off).most_common(3)]
        table = np.array([[c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)] for c in (spec, off)],
                         dtype=np.float64) + 0.5
        expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        assert chi2 < 16.27, f"position {position}: chi-square {chi2:.1f} over 3 degrees of freedom"


def test_stop_tokens_and_grammars_end_replies_where_they_did(tiny, oracle):
    from worker.grammar import GrammarEngine

    prompt = looping_prompts(tiny.model.hp.n_vocab, 1)[0]
    greedy = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    plain = run(tiny, [Generate("l", prompt, greedy, 30, stop_ids=[])], OFF).replies()["l"]
    stop_at = plain[12]  # a token of the reply's middle: both end there
    ended = check_lossless(tiny, [Generate("l", prompt, greedy, 30, stop_ids=[stop_at])], oracle, batches=(1,))
    assert ended["l"].replies()["l"][-1] == stop_at and ended["l"].finished()["l"].reason.value == "stop"

    grammar = GrammarEngine(tiny.tokenizer, tiny.model.hp.n_vocab)
    request = Generate("g", prompt[:-1], SamplingParams(temperature=0.0), 40, stop_ids=None,
                       grammar=Grammar("regex", "(ab|cd){3,30}"))
    # the grammar cuts a draft at the oracle's wrong token (validate_tokens): what is drafted stands
    held = check_lossless(tiny, [request], oracle, batches=(1,), grammar=grammar, refused=False)
    text = tiny.tokenizer.decode([t for t in held["g"].replies()["g"] if t not in tiny.tokenizer.stop_ids])
    assert text and set(text) <= set("abcd")


def test_a_request_may_turn_speculation_off(tiny):
    prompt = looping_prompts(tiny.model.hp.n_vocab, 1)[0]
    request = Generate("o", prompt, SamplingParams(temperature=0.0), 30, stop_ids=[], speculate=False)
    finished = run(tiny, [request], SPEC).finished()["o"]
    assert finished.drafted_tokens == 0 and finished.completion_tokens == 30


def test_the_default_model_copies_code_with_drafts_standing(default_model):
    """SmolLM2 asked to repeat a passage: the replies agree, and drafts that stood wrote a third
    of the reply or more (each of them a weight pass saved)."""
    engine = Engine.load(default_model)
    passage = ("def area(width, height):\n    return width * height\n\n\n"
               "def perimeter(width, height):\n    return 2 * (width + height)\n")
    text = (f"<|im_start|>user\nRepeat this code exactly:\n{passage}<|im_end|>\n"
            f"<|im_start|>assistant\n{passage[:20]}")
    prompt = engine.tokenizer.encode(text, parse_special=True)
    request = Generate("c", prompt, SamplingParams(temperature=0.0), 40)
    def counted(event: str) -> float:
        return REGISTRY.get_sample_value("lmserve_worker_speculative_tokens_total",
                                         {"kind": "ngram", "event": event}) or 0.0

    before = counted("drafted"), counted("accepted")
    on, off = run(engine, [request], SPEC), run(engine, [request], OFF)
    assert on.replies() == off.replies()
    finished = on.finished()["c"]
    assert finished.accepted_tokens >= finished.completion_tokens / 3 > 0
    # /metrics counts what the replies report
    assert (counted("drafted") - before[0], counted("accepted") - before[1]) == (
        finished.drafted_tokens, finished.accepted_tokens)


def test_every_dialect_reports_what_stood_and_a_request_may_opt_out(stack):
    """Over HTTP on the shared stack (speculation on by default): usage's extension names the
    drafted tokens and those that stood; ``speculation: false`` gives the same text without."""
    passage = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"
    ask = f"Repeat exactly: {passage}\nAgain: {passage}\nAgain:"
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": ask}]},
        "/v1/completions": {"prompt": ask},
        "/v1/responses": {"input": ask},
        "/v1/messages": {"messages": [{"role": "user", "content": ask}]},
    }
    for path, body in bodies.items():
        body = {"model": "m", "temperature": 0, **body,
                **({"max_output_tokens": 40} if path == "/v1/responses" else {"max_tokens": 40})}
        on = httpx.post(stack.url + path, json=body, timeout=120)
        off = httpx.post(stack.url + path, json={**body, "speculation": False}, timeout=120)
        assert on.status_code == off.status_code == 200, (path, on.text, off.text)
        assert text_of(on.json()) == text_of(off.json()) and text_of(on.json()), path
        spec = on.json()["usage"]["speculation"]
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] and spec["drafted_tokens"] > 0, path
        if path == "/v1/completions":  # a text continued: the passage comes a third time
            assert spec["accepted_tokens"] > 0
        assert "speculation" not in off.json()["usage"], path


def text_of(reply: dict) -> str:
    if "choices" in reply:
        choice = reply["choices"][0]
        return choice.get("text") or choice["message"]["content"]
    if "output" in reply:
        return "".join(part["text"] for item in reply["output"] if item["type"] == "message"
                       for part in item["content"])
    return "".join(block["text"] for block in reply["content"] if block["type"] == "text")


def test_a_draft_model_drafts_without_changing_a_token(tmp_path_factory, tiny):
    """--spec draft: the target itself as its draft model (every greedy draft stands) and another
    model of the same vocabulary (most are refused): the replies are decoding's own."""
    folder = tmp_path_factory.mktemp("draft")
    write_tiny_gguf(folder / "other.gguf", "llama", seed=2)
    prompts = looping_prompts(tiny.model.hp.n_vocab, 2)
    # the second reply outgrows its prompt plus a draft-model chunk: the draft's cache grows with it
    requests = [Generate(f"d{i}", p, SamplingParams(temperature=0.0), 24 + 300 * i, stop_ids=[])
                for i, p in enumerate(prompts)]
    plain = run(tiny, requests, OFF, batch=2, ctx=512).replies()
    for drafting, all_stand in ((tiny, True), (Engine.load(folder / "other.gguf"), False)):
        settings = SpeculationSettings(kinds=("draft",), max_draft=4, draft_engine=drafting)
        spec = run(tiny, requests, settings, batch=2, ctx=512)
        assert spec.replies() == plain
        finished = spec.finished().values()
        drafted, accepted = sum(f.drafted_tokens for f in finished), sum(f.accepted_tokens for f in finished)
        assert drafted > 0 and (accepted == drafted if all_stand else accepted < drafted)


def test_the_command_line_says_what_speculation_needs():
    from worker.flags import build_parser
    from worker.main import speculation_settings

    parse = build_parser().parse_args
    assert speculation_settings(parse([])).kinds == ("ngram",)
    assert speculation_settings(parse(["--spec", "off"])).on is False
    assert speculation_settings(parse(["--draft", "small.gguf"])).kinds == ("ngram", "draft")
    with pytest.raises(LmserveError, match="--draft MODEL"):
        speculation_settings(parse(["--spec", "draft"]))
    with pytest.raises(LmserveError, match="drafts with ngram, draft, mtp"):
        speculation_settings(parse(["--spec", "ngram,lookahead"]))
    assert speculation_settings(parse(["--spec", "mtp,ngram"])).kinds == ("mtp", "ngram")


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_behind_a_cartridge_and_through_the_kvstore_replies_are_unchanged(tmp_path_factory, oracle, name):
    """A conversation served behind a cartridge (where the family serves one), its KV spilled to
    a kvstore as it goes, and its next turn restored from there by a fresh scheduler: with
    speculation, every reply is the one written without (qwen35's recurrent states are spilled
    at chunk ends, drafts or not), and drafts stood."""
    from kvstore.store import DirectoryStore
    from worker.cartridges.cartridge import Cartridge, from_document, write
    from worker.kv_spill import KVSpiller

    engine = load_tiny(tmp_path_factory, name)
    folder = tmp_path_factory.mktemp(f"spill-{name}")
    cartridge = None  # a family with recurrent state serves no cartridge
    if engine.new_cache(1).rewindable:
        cache, tokens = from_document(engine, "The mill by the river grinds wheat every morning.", 12)
        write(folder / "doc.safetensors", engine, cache, tokens, "test document")
        cartridge = Cartridge.load(folder / "doc.safetensors", engine)
    first_prompt = looping_prompts(engine.model.hp.n_vocab, 1)[0]

    def conversation(settings: SpeculationSettings, store_dir) -> list[list[int]]:
        replies, prompt = [], list(first_prompt)
        for turn in range(2):
            spiller = KVSpiller(DirectoryStore(store_dir, 1 << 28), engine.fingerprint, 16)
            request = Generate(f"t{turn}", prompt, SamplingParams(temperature=0.0), 24, stop_ids=[])
            outbox = run(engine, [request], settings, spiller=spiller, cartridge=cartridge)
            reply = outbox.replies()[f"t{turn}"]
            if turn:  # the first turn's chunks came back from the kvstore
                assert outbox.finished()[f"t{turn}"].cached_tokens >= 16
            spiller.flush()
            spiller.close()
            replies.append(reply)
            prompt = prompt + reply + first_prompt[:5]  # the next turn holds this one
        return replies

    plain = conversation(OFF, folder / "off")
    for turn, reply in enumerate(plain):  # the oracle drafts each turn's true reply
        prompt = list(first_prompt)
        for earlier in plain[:turn]:
            prompt = prompt + earlier + first_prompt[:5]
        oracle[tuple(prompt)] = reply
    finished_before = REGISTRY.get_sample_value("lmserve_worker_speculative_tokens_total",
                                                {"kind": "ngram", "event": "accepted"}) or 0.0
    assert conversation(SPEC, folder / "on") == plain
    assert (REGISTRY.get_sample_value("lmserve_worker_speculative_tokens_total",
                                      {"kind": "ngram", "event": "accepted"}) or 0.0) > finished_before


@pytest.fixture(scope="module", params=sorted(MTP_FIXTURES))
def with_mtp(request, tmp_path_factory) -> Engine:
    arch, overrides = MTP_FIXTURES[request.param]
    path = tmp_path_factory.mktemp("mtp") / f"{request.param}.gguf"
    write_tiny_gguf(path, arch, seed=1, **overrides)
    return Engine.load(path)


def test_the_mtp_block_drafts_without_changing_a_token(with_mtp):
    """--spec mtp on Qwen3.5-shaped files with an MTP block: greedy and seeded replies, alone
    and in a batch, and a second turn over the first's resident cache (whose positions the
    block reads without states), are decoding's own; the block drafted."""
    engine = with_mtp
    mtp = SpeculationSettings(kinds=("mtp",), max_draft=4, model=engine.model)
    prompts = looping_prompts(engine.model.hp.n_vocab, 3)
    requests = [Generate(f"m{i}", p, SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=i), 20, stop_ids=[])
                for i, p in enumerate(prompts)]
    for batch in (1, 3):
        plain, spec = run(engine, requests, OFF, batch=batch), run(engine, requests, mtp, batch=batch)
        assert spec.replies() == plain.replies() and spec.logprobs() == plain.logprobs()
        assert sum(f.drafted_tokens for f in spec.finished().values()) > 0
    first = requests[0].prompt + run(engine, requests[:1], OFF).replies()["m0"]
    turns = [requests[0], Generate("again", first + prompts[1][:4], SamplingParams(temperature=0.0), 20, stop_ids=[])]
    plain, spec = run(engine, turns, OFF), run(engine, turns, mtp)
    assert spec.finished()["again"].cached_tokens > 0, "the second turn reused the first's cache"
    assert spec.replies() == plain.replies()


def test_the_mtp_block_drafts_what_it_drafts_reading_the_whole_sequence(with_mtp, oracle, monkeypatch):
    """What the block drafts in serving, after passes that kept drafts and passes that cut them
    back, is what it drafts having read the stream's tokens with their states in one pass from
    scratch: the states reach it from every pass, for the tokens kept, in order."""
    engine, model = with_mtp, with_mtp.model
    asked = []
    propose = MtpDrafter.propose

    def recorded(self, limit):
        drafts = propose(self, limit)
        asked.append((list(self.cache.tokens), self.last, limit, drafts))
        return drafts

    monkeypatch.setattr(MtpDrafter, "propose", recorded)
    calls = Counter()

    class Sometimes(Oracle):  # the oracle's drafts every other pass (they stand), the block's between
        def propose(self, limit):
            calls[id(self)] += 1
            return super().propose(limit) if calls[id(self)] % 2 else []

    monkeypatch.setattr("worker.speculation.NgramIndex", Sometimes)
    prompts = looping_prompts(model.hp.n_vocab, 2)
    requests = [Generate(f"w{i}", p, SamplingParams(temperature=0.0), 24, stop_ids=[]) for i, p in enumerate(prompts)]
    for r in requests:
        oracle[tuple(r.prompt)] = run(engine, [r], OFF).replies()[r.request_id]
    spec = run(engine, requests, SpeculationSettings(kinds=("ngram", "mtp"), max_draft=4, model=model), batch=2)
    assert spec.replies() == {r.request_id: oracle[tuple(r.prompt)] for r in requests}
    assert sum(f.accepted_tokens for f in spec.finished().values()) > 0, "the oracle's drafts stood"
    assert len(asked) >= 8
    for held, last, limit, drafts in asked:
        states: list[np.ndarray] = []
        model.forward([(engine.new_cache(len(held) + 1), held)], hidden_out=states)
        state = model.new_mtp_state(len(held) + limit + 1)
        model.mtp_accept(state, held, states[0])
        assert model.mtp_draft(state, last, limit) == drafts


def test_a_worker_drafts_with_the_mtp_block_it_has_and_refuses_one_it_lacks(with_mtp, tiny, start_worker,
                                                                             start_gateway):
    """``lmserve worker --spec mtp``: over HTTP with the official SDK, a reply with the MTP
    block drafting is the reply without; a model without MTP layers is refused at start."""
    import logging

    from openai import OpenAI

    from worker.main import with_drafters

    with pytest.raises(LmserveError, match="no multi-token-prediction layers"):
        with_drafters(SpeculationSettings(kinds=("mtp",)), None, tiny, logging.getLogger("test"))
    worker = start_worker(with_mtp.model.path, "--spec", "mtp", "--spec-max", "3", "--ctx", "256")
    client = OpenAI(base_url=start_gateway(worker).url + "/v1", api_key="unused")
    prompt = looping_prompts(with_mtp.model.hp.n_vocab, 1)[0]
    replies = [client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"speculation": on}) for on in (True, False)]
    assert replies[0].choices[0].text == replies[1].choices[0].text and replies[0].choices[0].text
    assert replies[0].usage.model_extra["speculation"]["drafted_tokens"] > 0
