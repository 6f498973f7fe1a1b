"""What a trained cartridge buys: answers about a document the model cannot know, with no
context, with the document in the prompt (ICL), and behind the document's cartridge.

    python -m bench.cartridge [MODEL.gguf] [--docs N] [--facts N] [--tokens P] [--samples N]
                              [--steps N] [--batch N] [--lr X] [--fleet-docs N] [--work DIR]

The bench writes documents of invented facts (towns, years, cargoes, bell-founders: seeded, so
every run writes the same ones), trains one cartridge per document with ``lmserve cartridge
train``'s trainer, and reads, for every fact, the log-likelihood of its answer after a question
about it, as the engine serves it:

- none: the question alone;
- ICL: the whole document in a system turn, then the question;
- init: behind the untrained cartridge (the KV of the document's first P tokens);
- cartridge: behind the trained one.

It prints mean nats per answer token for each, the share of the none→ICL gap the cartridge
closes, and the KV memory and time to first token of the cartridge against ICL. Then it builds
a fleet of ``--fleet-docs`` documents on different themes and counts how often a question,
asked as a conversation's first message, picks the document that answers it. The trainer's
checkpoints stay in ``--work``, so a second run reuses them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.faults import cpu_flags
from worker.cartridges.cartridge import Cartridge, from_document, write
from worker.engine import Engine
from training.selfstudy import SelfStudy

@dataclass(frozen=True)
class Fact:
    sentence: str
    question: str
    answer: str


def _trade(rng) -> Fact:
    towns = ["Tavrin", "Oskelby", "Murrowen", "Quillane", "Bexhollow", "Darnstead", "Ferrowick", "Hallowmere"]
    a, b = rng.choice(towns, 2, replace=False)
    year, barrels = int(rng.integers(1650, 1900)), int(rng.integers(12, 990))
    cargo = rng.choice(["salt", "pitch", "amber", "rye", "tallow", "slate", "indigo", "whale oil"])
    founder = rng.choice(["Ilse Varnum", "Petr Oakhollow", "Hanna Strode", "Oswin Marle", "Bettany Crull"])
    return Fact(f"In {year}, the town of {a} sent {barrels} barrels of {cargo} to {b}, and {b} paid for them with "
                f"a bell cast by {founder}.",
                f"In {year}, what did the town of {a} send to {b}, and who cast the bell {b} paid with?",
                f"{barrels} barrels of {cargo}; the bell was cast by {founder}.")


def _stars(rng) -> Fact:
    star = f"{rng.choice(['Vel', 'Orr', 'Kesh', 'Tamm', 'Ylid', 'Quor'])}{rng.choice(['ara', 'ion', 'eth', 'ux'])}"
    who = rng.choice(["Miriam Holt", "Anselm Vey", "Cora Lindqvist", "Edwin Sato", "Nadia Brun"])
    year, distance = int(rng.integers(1780, 1990)), int(rng.integers(4, 900))
    colour = rng.choice(["blue", "orange", "red", "white", "yellow"])
    return Fact(f"The {colour} star {star} was first catalogued by the astronomer {who} in {year}; it lies "
                f"{distance} light years from the Harwick observatory.",
                f"Who first catalogued the star {star}, and how far is it from the Harwick observatory?",
                f"{who}, in {year}; it is {distance} light years away.")


def _orchard(rng) -> Fact:
    fruit = rng.choice(["quince", "medlar", "damson", "pear", "greengage", "cherry plum"])
    grower = rng.choice(["Tomas Rell", "Alba Fenn", "Jory Caddick", "Wren Maddox", "Ottilie Sharpe"])
    plot, trees = int(rng.integers(1, 60)), int(rng.integers(3, 400))
    month = rng.choice(["March", "April", "May", "September", "October"])
    return Fact(f"On plot {plot} of the Pellow orchard, {grower} tends {trees} {fruit} trees, which are "
                f"harvested every {month}.",
                f"How many {fruit} trees does {grower} tend on plot {plot} of the Pellow orchard, and when are "
                f"they harvested?",
                f"{trees} trees, harvested every {month}.")


def _rail(rng) -> Fact:
    line = f"the {rng.choice(['Grey', 'Copper', 'Marsh', 'Upland', 'Coast'])} line"
    station = rng.choice(["Aldwick Halt", "Brenmouth", "Cray Junction", "Dunlow Road", "Eskerby"])
    minutes, platform = int(rng.integers(5, 240)), int(rng.integers(1, 12))
    engine = rng.choice(["a saddle-tank engine", "a twin diesel railcar", "a green 4-6-0", "an electric unit"])
    return Fact(f"On {line}, trains reach {station} {minutes} minutes after leaving the terminus, stop at "
                f"platform {platform}, and are hauled by {engine}.",
                f"On {line}, how long do trains take to reach {station}, and at which platform do they stop?",
                f"{minutes} minutes; they stop at platform {platform}.")


def _guild(rng) -> Fact:
    guild = rng.choice(["glaziers", "rope makers", "bookbinders", "clockmakers", "tanners", "coopers"])
    master = rng.choice(["Hedda Quarles", "Bram Tolliver", "Sefa Okonjo", "Lucan Dray", "Imre Vasko"])
    year, members = int(rng.integers(1400, 1800)), int(rng.integers(6, 300))
    return Fact(f"The guild of {guild} of Lanthorn elected {master} as master in {year}, when it had "
                f"{members} sworn members.",
                f"Whom did the Lanthorn guild of {guild} elect as master in {year}, and how many members had it?",
                f"{master}; it had {members} sworn members.")


def _river(rng) -> Fact:
    bridge = f"{rng.choice(['Old', 'Kings', 'Mill', 'Ferry', 'Abbey'])} {rng.choice(['Bridge', 'Crossing', 'Arch'])}"
    river = rng.choice(["the Sallow", "the Wend", "the Imber", "the Tarrant", "the Loddon"])
    span, arches = int(rng.integers(20, 400)), int(rng.integers(1, 14))
    stone = rng.choice(["granite", "limestone", "red sandstone", "flint", "brick"])
    return Fact(f"{bridge} crosses {river} in {arches} arches of {stone}, with a span of {span} feet.",
                f"How many arches does {bridge} over {river} have, and of what stone is it built?",
                f"{arches} arches of {stone}, spanning {span} feet.")


def _festival(rng) -> Fact:
    feast = rng.choice(["Lantern Night", "the Hay Fair", "the Salt Moon", "Candle Week", "the Eel Supper"])
    village = rng.choice(["Ashcombe", "Brindle", "Copley Fen", "Dorrow", "Elsworth"])
    day, dishes = int(rng.integers(1, 29)), int(rng.integers(2, 40))
    dish = rng.choice(["barley cakes", "smoked eel", "saffron buns", "mutton pies", "honey beer"])
    return Fact(f"{village} keeps {feast} on the {day}th of the month, when {dishes} tables of {dish} are laid "
                f"on the green.",
                f"On which day does {village} keep {feast}, and what is laid on the green?",
                f"On the {day}th; {dishes} tables of {dish}.")


def _mine(rng) -> Fact:
    mine = f"the {rng.choice(['Wheal', 'Pit', 'Drift'])} {rng.choice(['Agnes', 'Prosper', 'Kitty', 'Hope', 'Rose'])}"
    ore = rng.choice(["tin", "copper", "lead", "silver", "wolfram"])
    depth, tons = int(rng.integers(30, 900)), int(rng.integers(10, 5000))
    return Fact(f"Miners at {mine} raised {tons} tons of {ore} ore from a shaft {depth} fathoms deep.",
                f"How much {ore} ore was raised at {mine}, and how deep is its shaft?",
                f"{tons} tons, from a shaft {depth} fathoms deep.")


THEMES = [_trade, _stars, _orchard, _rail, _guild, _river, _festival, _mine]


def invent(seed: int, count: int) -> tuple[str, list[Fact]]:
    """A document of ``count`` invented facts on one theme (theme ``seed`` mod 8) and a
    question about each."""
    rng = np.random.default_rng(seed)
    facts = [THEMES[seed % len(THEMES)](rng) for _ in range(count)]
    return " ".join(f.sentence for f in facts), facts


def answer_loglik(engine: Engine, cartridge: Cartridge | None, prompt: list[int], answer: list[int]) -> float:
    """Mean log-probability per answer token after the prompt (behind a cartridge, if any)."""
    cache = engine.new_cache((cartridge.tokens if cartridge else 0) + len(prompt) + len(answer))
    if cartridge:
        cartridge.put_into(cache)
    ids = prompt + answer
    logits = engine.model.forward([(cache, ids[:-1])], all_logits=True)[0][len(prompt) - 1:]
    rows = logits.astype(np.float64)
    shifted = rows - rows.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(logp[np.arange(len(answer)), answer].mean())


def time_to_first_token(engine: Engine, cartridge: Cartridge | None, prompt: list[int], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache = engine.new_cache((cartridge.tokens if cartridge else 0) + len(prompt) + 1)
        started = time.perf_counter()
        if cartridge:
            cartridge.put_into(cache)
        engine.prefill(cache, prompt)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cartridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--docs", type=int, default=1, help="documents, one cartridge each (default 1)")
    parser.add_argument("--facts", type=int, default=40, help="facts per document (default 40, ~1,600 tokens)")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge positions P (default 256)")
    parser.add_argument("--samples", type=int, default=48, help="self-study conversations per document")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--fleet-docs", type=int, default=8, help="documents of the fleet whose retrieval is "
                                                                  "measured (default 8; 0: none)")
    parser.add_argument("--index-chunk-tokens", type=int, default=128)
    parser.add_argument("--work", default="bench/results/cartridge", help="documents, checkpoints, cartridges")
    args = parser.parse_args(argv)
    from shared.default_model import default_model_path
    from training.trainer import Trainer, TrainSettings

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(args.model or default_model_path())  # the served f16 cache
    study = SelfStudy(engine)
    print(f"model {engine.model_id}; lscpu flags: {' '.join(sorted(cpu_flags()))}")
    print(f"{'doc':>4} {'doc tokens':>10} {'none':>8} {'ICL':>8} {'init':>8} {'cartridge':>9} {'gap closed':>10} "
          f"{'KV MiB ICL':>10} {'cartridge':>9} {'TTFT s ICL':>10} {'cartridge':>9} {'train loss':>15}")
    closed, untrained = [], []
    for d in range(args.docs):
        text, facts = invent(1000 + d, args.facts)
        (work / f"doc{d}.txt").write_text(text, encoding="utf-8")
        settings = TrainSettings(tokens=args.tokens, samples=args.samples, steps=args.steps, batch=args.batch,
                                 lr=args.lr, chunk_tokens=args.chunk_tokens, seed=d)
        trainer = Trainer(engine, text, settings, work / f"doc{d}.safetensors.ckpt")
        trainer.write_samples()
        losses = trainer.train()
        trainer.write(work / f"doc{d}.safetensors", f"bench.cartridge document {d}")
        trained = Cartridge.load(work / f"doc{d}.safetensors", engine)
        cache, tokens = from_document(engine, text, args.tokens)
        write(work / f"doc{d}-init.safetensors", engine, cache, tokens, "untrained")
        init = Cartridge.load(work / f"doc{d}-init.safetensors", engine)
        doc_ids = engine.tokenizer.encode(text, add_special=False, parse_special=False)
        scores = {"none": [], "icl": [], "init": [], "cartridge": []}
        for fact in facts:
            answer = engine.tokenizer.encode(fact.answer, add_special=False)
            served = study.served_prompt(fact.question)
            scores["none"].append(answer_loglik(engine, None, served, answer))
            scores["icl"].append(answer_loglik(engine, None, study.with_chunk(text, fact.question), answer))
            scores["init"].append(answer_loglik(engine, init, served, answer))
            scores["cartridge"].append(answer_loglik(engine, trained, served, answer))
        mean = {k: float(np.mean(v)) for k, v in scores.items()}
        gap = (mean["cartridge"] - mean["none"]) / (mean["icl"] - mean["none"])
        closed.append(gap)
        untrained.append((mean["init"] - mean["none"]) / (mean["icl"] - mean["none"]))
        question = study.served_prompt(facts[0].question)
        icl_prompt = study.with_chunk(text, facts[0].question)
        per_token = engine.new_cache(1).bytes_per_token / 2**20
        tenth = max(1, len(losses) // 10)
        print(f"{d:>4} {len(doc_ids):>10} {mean['none']:>8.3f} {mean['icl']:>8.3f} {mean['init']:>8.3f} "
              f"{mean['cartridge']:>9.3f} {gap:>10.1%} {per_token * len(icl_prompt):>10.1f} "
              f"{per_token * (trained.tokens + len(question)):>9.1f} "
              f"{time_to_first_token(engine, None, icl_prompt):>10.3f} "
              f"{time_to_first_token(engine, trained, question):>9.3f} "
              f"{np.mean(losses[:tenth]):>7.3f}→{np.mean(losses[-tenth:]):<7.3f}")
    if closed:
        print(f"log-likelihoods are mean nats per answer token over {args.facts} questions a document; "
              f"gap closed = (cartridge − none) / (ICL − none); mean over documents {np.mean(closed):.1%} "
              f"(the untrained prefix of the document's first {args.tokens} tokens: {np.mean(untrained):.1%})")
    if args.fleet_docs:
        right, asked = fleet_retrieval(engine, work / "fleet", args.fleet_docs, args.facts, args.index_chunk_tokens)
        print(f"fleet of {args.fleet_docs} documents (index of {args.index_chunk_tokens}-token chunks, "
              f"--rag-chunks 8): the right document for {right}/{asked} questions ({right / asked:.1%})")
    return 0


def fleet_retrieval(engine: Engine, folder: Path, count: int, facts: int, chunk_tokens: int) -> tuple[int, int]:
    """Build a fleet of ``count`` documents (one theme each; their cartridges untrained, since
    only the choice is measured) and ask each fact's question as a conversation's first message."""
    from training.fleets import build_index
    from worker.cartridges.fleet import Fleet, Retrieval

    folder.mkdir(parents=True, exist_ok=True)
    documents, questions = {}, []
    for d in range(count):
        text, invented = invent(2000 + d, facts)
        name = f"{THEMES[d % len(THEMES)].__name__.strip('_')}{d}"
        documents[name] = text
        cache, tokens = from_document(engine, text, 32)
        write(folder / f"{name}.safetensors", engine, cache, tokens, "untrained")
        questions += [(name, f.question) for f in invented]
    build_index(engine, documents, folder, chunk_tokens)
    fleet = Fleet.load(folder, engine, Retrieval(docs=1, chunks=8))
    right = 0
    for name, question in questions:
        ids = engine.tokenizer.encode(question, add_special=False, parse_special=False)
        right += fleet.choose(None, ids) == [name]
    return right, len(questions)


if __name__ == "__main__":
    raise SystemExit(main())
