"""bench.cartridge end to end on a tiny model: documents invented, a cartridge trained, the four
conditions measured, a fleet built and asked. The figures of a random model mean nothing; what
is checked is that every row is there and that the log-likelihoods are ones (the answer's own
log-probabilities, each a mean of negative numbers). ``python -m bench.cartridge`` runs it on the
default model."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest.importorskip("torch")

from bench.cartridge import THEMES, answer_loglik, invent, main  # noqa: E402


def test_invented_documents_hold_their_answers():
    for seed in range(len(THEMES)):
        text, facts = invent(seed, 5)
        assert len(facts) == 5 and all(f.sentence in text for f in facts)
        # the answer's facts (its numbers) are in the sentence, not in the question alone
        for fact in facts:
            numbers = re.findall(r"\d+", fact.answer)
            assert numbers and all(n in fact.sentence for n in numbers)
    assert invent(3, 4) == invent(3, 4) and invent(3, 4) != invent(11, 4)


def test_the_bench_runs_on_a_tiny_model(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "llama.gguf", "llama", context_length=1024)
    assert main([str(tmp_path / "llama.gguf"), "--facts", "4", "--tokens", "8", "--samples", "2", "--steps", "2",
                 "--chunk-tokens", "64", "--fleet-docs", "2", "--index-chunk-tokens", "32",
                 "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split() and line.split()[0] == "0")
    figures = row.split()
    none, icl, init, cartridge = map(float, figures[2:6])
    assert all(v < 0 for v in (none, icl, init, cartridge))
    assert (tmp_path / "work" / "doc0.safetensors").is_file()
    assert re.search(r"fleet of 2 documents .*: the right document for \d+/8 questions", out)


def test_answer_loglik_is_the_mean_log_probability(tmp_path):
    from worker.engine import Engine

    write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    engine = Engine.load(tmp_path / "llama.gguf", kv_type="f32")
    prompt, answer = [10, 11, 12], [13, 14]
    logits = engine.model.forward([(engine.new_cache(8), prompt + answer[:1])], all_logits=True)[0][-2:]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = (logp[0, 13] + logp[1, 14]) / 2
    assert answer_loglik(engine, None, prompt, answer) == pytest.approx(expected, abs=1e-4)
