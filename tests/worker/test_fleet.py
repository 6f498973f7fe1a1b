"""Fleets (worker/cartridges/fleet.py): a cartridge per document and an index of the served model's own
pooled hidden states. A message retrieves its document; the choice is kept per conversation (in
Redis, shared between workers), switched only when adaptive and out-scored by the margin; several
compose; a worker and gateway serve it in every dialect; bad setups fail at start with the reason."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from tiny_models import write_tiny_gguf

pytest.importorskip("torch")

from worker.cartridges.cartridge import compose  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.cartridges.fleet import INDEX_FILE, Fleet, Retrieval  # noqa: E402

DOCUMENTS = {
    "lighthouse": "The lighthouse on Varrow Point was built in 1871 by Ada Quint, who painted it green and kept "
                  "its lamp for forty years. Ships from Hollin carried her oil across the bay every spring.",
    "mill": "The Ostrel mill grinds barley only on Thursdays, when the river runs fastest past the weir, and its "
            "miller sings to the stones while the wheel turns.",
    "orchard": "Quince trees of the Pellow orchard flower in late March; the keeper, Tomas Rell, grafts "
               "twelve new saplings each autumn and sells the fruit at Dunmore market.",
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    docs = folder / "docs"
    docs.mkdir()
    for name, text in DOCUMENTS.items():
        (docs / f"{name}.txt").write_text(text, encoding="utf-8")
    (docs / "notes.json").write_text("{}", encoding="utf-8")  # not a document
    write_tiny_gguf(folder / "llama.gguf", "llama", context_length=512)
    flags = ["--model", str(folder / "llama.gguf"), "--tokens", "8", "--samples", "2", "--steps", "2",
             "--batch", "1", "--chunk-tokens", "32", "--index-chunk-tokens", "16"]
    done = run_cli("cartridge", "fleet", str(docs), "--out", str(folder / "fleet"), *flags)
    assert done.returncode == 0, done.stderr
    assert "3 cartridges" in done.stdout and "chunks" in done.stdout
    again = run_cli("cartridge", "fleet", str(docs), "--out", str(folder / "fleet"), *flags)
    assert again.returncode == 0 and again.stdout.count(": kept ") == 3  # finished ones are not trained again
    return folder


def chunk_of(engine: Engine, name: str, start: int = 0) -> list[int]:
    """Index chunk ``start`` of a document, as ids (16-token chunks, as indexed above)."""
    ids = engine.tokenizer.encode(DOCUMENTS[name], add_special=False, parse_special=False)
    return ids[16 * start:16 * start + 16]


def test_a_message_retrieves_its_document(fleet_dir):
    engine = Engine.load(fleet_dir / "llama.gguf")
    fleet = Fleet.load(fleet_dir / "fleet", engine, Retrieval(docs=1, chunks=4))
    assert fleet.names == sorted(DOCUMENTS) and all((fleet_dir / "fleet" / f"{n}.safetensors").is_file()
                                                    for n in DOCUMENTS)
    for name in DOCUMENTS:
        for start in (0, 1):
            scores = fleet.scores(chunk_of(engine, name, start))
            assert max(scores, key=scores.get) == name, scores
    two = Fleet.load(fleet_dir / "fleet", engine, Retrieval(docs=2, chunks=4))
    chosen = two.choose(None, chunk_of(engine, "mill"))
    assert chosen[0] == "mill" and len(set(chosen)) == 2
    composed = compose([two.cartridges[n] for n in chosen], engine)
    assert composed.names == chosen and composed.tokens == 16 and two.prefix_tokens == 16


def test_the_choice_is_kept_per_conversation_and_shared_through_redis(fleet_dir, start_redis, tmp_path):
    from kvstore.store import RedisStore

    from prometheus_client import REGISTRY

    def counted(how: str) -> float:
        return REGISTRY.get_sample_value("lmserve_worker_fleet_choices_total", {"how": how}) or 0.0

    before = {how: counted(how) for how in ("new", "kept", "switched")}
    engine = Engine.load(fleet_dir / "llama.gguf")
    redis = start_redis()
    one = Fleet.load(fleet_dir / "fleet", engine, Retrieval(), RedisStore(redis.url))
    other = Fleet.load(fleet_dir / "fleet", engine, Retrieval(), RedisStore(redis.url))
    assert one.choose("c1", chunk_of(engine, "orchard")) == ["orchard"]
    # a later turn about another document keeps the first choice, on another worker too
    assert other.choose("c1", chunk_of(engine, "lighthouse")) == ["orchard"]
    assert other.choose("c2", chunk_of(engine, "lighthouse")) == ["lighthouse"]
    # adaptive: out-scored by more than the margin, the conversation switches; with a margin no
    # score difference reaches, it stays
    stays = Fleet.load(fleet_dir / "fleet", engine, Retrieval(adaptive=True, margin=5.0), RedisStore(redis.url))
    assert stays.choose("c1", chunk_of(engine, "mill")) == ["orchard"]
    switches = Fleet.load(fleet_dir / "fleet", engine, Retrieval(adaptive=True, margin=0.05), RedisStore(redis.url))
    assert switches.choose("c1", chunk_of(engine, "mill")) == ["mill"]
    assert one.choose("c1", []) == ["mill"]  # the switch is what every worker now keeps
    assert {how: counted(how) - before[how] for how in before} == {"new": 2, "kept": 3, "switched": 1}
    # the index went into Redis with the first load: a worker given the cartridges alone reads it
    import shutil

    from shared.errors import ModelLoadError

    alone_dir = tmp_path / "cartridges-only"
    alone_dir.mkdir()
    for name in DOCUMENTS:
        shutil.copy(fleet_dir / "fleet" / f"{name}.safetensors", alone_dir)
    from_redis = Fleet.load(alone_dir, engine, Retrieval(), RedisStore(redis.url))
    assert from_redis.scores(chunk_of(engine, "mill")) == one.scores(chunk_of(engine, "mill"))
    assert from_redis.choose("c1", []) == ["mill"]  # the same fleet: the same choices
    with pytest.raises(ModelLoadError, match="no kvstore holds one"):
        Fleet.load(alone_dir, engine, Retrieval())
    # without a kvstore the choices are this process's
    alone = Fleet.load(fleet_dir / "fleet", engine, Retrieval())
    assert alone.choose("c1", chunk_of(engine, "lighthouse")) == ["lighthouse"]
    assert alone.choose("c1", chunk_of(engine, "mill")) == ["lighthouse"]


def test_a_fleet_is_served_in_every_dialect(fleet_dir, start_worker, start_gateway):
    engine = Engine.load(fleet_dir / "llama.gguf")
    worker = start_worker(fleet_dir / "llama.gguf", "--fleet", str(fleet_dir / "fleet"), "--ctx", "256")
    gateway = start_gateway(worker)
    assert worker.card().context_budget == 256 - 8
    listed = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]
    assert listed["fleet"] == sorted(DOCUMENTS) and listed["default_cartridge"] is None
    text = {name: engine.tokenizer.decode(chunk_of(engine, name)) for name in DOCUMENTS}
    for path, body in (("/v1/chat/completions", {"max_tokens": 3}), ("/v1/responses", {"max_output_tokens": 3}),
                       ("/v1/messages", {"max_tokens": 3})):
        key = "input" if path == "/v1/responses" else "messages"
        opening = [{"role": "user", "content": text["mill"]}]
        first = httpx.post(gateway.url + path, json={"model": "m", key: opening, **body}, timeout=60)
        assert first.status_code == 200, first.text
        assert first.headers["x-lmserve-cartridges"] == "mill" and first.json()["usage"]["cartridges"] == ["mill"]
        # the same conversation's next turn, about another document, keeps its cartridge
        follow = opening + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": text["orchard"]}]
        second = httpx.post(gateway.url + path, json={"model": "m", key: follow, **body}, timeout=60)
        assert second.headers["x-lmserve-cartridges"] == "mill"
        # a new conversation about it gets its own; naming cartridges overrides the fleet
        fresh = httpx.post(gateway.url + path, json={"model": "m", key: [{"role": "user", "content": text["orchard"]
                                                                           + " " + path}], **body}, timeout=60)
        assert fresh.headers["x-lmserve-cartridges"] == "orchard"
        named = httpx.post(gateway.url + path, json={"model": "m", key: opening, **body,
                                                      "cartridges": ["lighthouse"]}, timeout=60)
        assert named.headers["x-lmserve-cartridges"] == "lighthouse"


def test_bad_fleets_fail_at_start_with_the_reason(fleet_dir, tmp_path):
    model = str(fleet_dir / "llama.gguf")
    both = run_cli("worker", model, "--fleet", str(fleet_dir / "fleet"), "--cartridge",
                   str(fleet_dir / "fleet" / "mill.safetensors"))
    assert both.returncode == 2 and "--fleet excludes --cartridge" in both.stderr
    (tmp_path / "empty").mkdir()
    none = run_cli("worker", model, "--fleet", str(tmp_path / "empty"), "--worker", "tcp://127.0.0.1:1")
    assert none.returncode == 2 and f"holds no {INDEX_FILE}" in none.stderr
    many = run_cli("worker", model, "--fleet", str(fleet_dir / "fleet"), "--rag-docs", "4",
                   "--worker", "tcp://127.0.0.1:1")
    assert many.returncode == 2 and "more cartridges than the fleet's 3 documents" in many.stderr
    tight = run_cli("worker", model, "--fleet", str(fleet_dir / "fleet"), "--rag-docs", "2", "--ctx", "16",
                    "--worker", "tcp://127.0.0.1:1")
    assert tight.returncode == 2 and "take 16 positions, which leaves no room" in tight.stderr
    write_tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", context_length=512)
    other = run_cli("worker", str(tmp_path / "qwen3.gguf"), "--fleet", str(fleet_dir / "fleet"),
                    "--worker", "tcp://127.0.0.1:1")
    assert other.returncode == 2 and "made with another model" in other.stderr
    no_docs = run_cli("cartridge", "fleet", str(tmp_path / "empty"), "--out", str(tmp_path / "f"), "--model", model)
    assert no_docs.returncode != 0 and "holds no documents" in no_docs.stderr


def test_the_choice_is_made_on_the_engine_thread_before_the_request_is_queued(fleet_dir):
    """Submitting (the IO thread) only checks the request: embedding the message is a forward
    pass, which runs where every other one runs, so the answer waits for choose_cartridges."""
    from shared.protocol import Accepted, Generate, Rejected
    from shared.sampling_params import SamplingParams
    from worker.scheduler import Scheduler, SchedulerSettings

    engine = Engine.load(fleet_dir / "llama.gguf")
    fleet = Fleet.load(fleet_dir / "fleet", engine, Retrieval())
    outbox: list = []
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, fleet=fleet), lambda _, m: outbox.append(m))
    ask = Generate("r1", [5, 6, 7], SamplingParams(temperature=0.0), 2, conversation="c9",
                   query=chunk_of(engine, "orchard"))
    scheduler.submit(b"gw", ask)
    assert outbox == [] and len(scheduler.retrieving) == 1
    scheduler.choose_cartridges()
    assert [type(m) for m in outbox] == [Accepted] and outbox[0].cartridges == ["orchard"]
    scheduler.submit(b"gw", Generate("r2", [5], SamplingParams(), 2, query=[10**9]))
    assert isinstance(outbox[-1], Rejected) and "query must be token ids" in outbox[-1].message
