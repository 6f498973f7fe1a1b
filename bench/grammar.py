"""Decode speed with and without a JSON-schema constraint, side by side.

    python -m bench.grammar [MODEL.gguf] [--tokens 96] [--repeats 3] [--batch 4]

Runs the worker's scheduler in this process on the default model: the same prompts decoded
freely and under a JSON schema (one llguidance matcher per stream, one bitmask per step for the
batch). Constrained streams stop when their JSON is complete, so speeds are per generated token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shared.protocol import Finished, Generate, Grammar
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.grammar import GrammarEngine
from worker.scheduler import Scheduler, SchedulerSettings

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "score": {"type": "number"}, "ok": {"type": "boolean"}},
    "required": ["name", "tags", "score", "ok"], "additionalProperties": False}


class _Collect:
    def __init__(self):
        self.finished: list[Finished] = []

    def __call__(self, gateway, message):
        if isinstance(message, Finished):
            self.finished.append(message)


def run(engine: Engine, grammar: GrammarEngine, batch: int, tokens: int, constrained: bool) -> float:
    outbox = _Collect()
    scheduler = Scheduler(engine, SchedulerSettings(ctx=512, batch=batch, kv_slots=batch, queue=batch), outbox,
                          grammar=grammar)
    scheduler.wake_io = scheduler.admit_compiled
    spec = Grammar("json_schema", json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        scheduler.submit(b"bench", Generate(f"r{i}", [1, 9690, 30, 1669 + i], SamplingParams(temperature=0.8, seed=i),
                                            tokens, stop_ids=[] if not constrained else None, grammar=spec))
    deadline = time.monotonic() + 30
    while len(scheduler.waiting) < batch and time.monotonic() < deadline:
        time.sleep(0.01)  # compiles land on the pool
    scheduler.admit()
    scheduler.step()  # prefill: not part of decode speed
    produced_before = len(scheduler.running)
    started = time.perf_counter()
    while scheduler.running or scheduler.waiting:
        scheduler.admit()
        scheduler.step()
    elapsed = time.perf_counter() - started
    produced = sum(f.completion_tokens for f in outbox.finished) - produced_before
    return produced / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    from shared.default_model import default_model_path
    engine = Engine.load(args.model or default_model_path())
    grammar = GrammarEngine(engine.tokenizer, engine.model.hp.n_vocab)
    grammar.ll_tokenizer()
    print(f"decode tokens/s, all streams together (min / median / max over {args.repeats})")
    print(f"{'streams':>8s} {'free':>26s} {'JSON schema':>26s} {'ratio':>7s}")
    for batch in (1, args.batch):
        free = [run(engine, grammar, batch, args.tokens, False) for _ in range(args.repeats)]
        bound = [run(engine, grammar, batch, args.tokens, True) for _ in range(args.repeats)]
        cells = [f"{min(v):7.1f} {statistics.median(v):7.1f} {max(v):7.1f}" for v in (free, bound)]
        print(f"{batch:8d} {cells[0]:>26s} {cells[1]:>26s} {statistics.median(bound) / statistics.median(free):6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
