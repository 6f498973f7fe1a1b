"""Scripted replies (``--scripted-replies``, a test input) through the real scheduler, in-process.

The script decides each token; the engine still runs every step, so the reported logprobs are
those of the real logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import LmserveError
from shared.protocol import Finished, Generate, Tokens
from shared.sampling_params import SamplingParams
from worker.engine import ops
from worker.engine import Engine
from worker.scheduler import Scheduler, SchedulerSettings
from worker.scripted import ScriptedReplies, end_of_turn_id


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=2)
    return Engine.load(path)


def run(engine: Engine, script: ScriptedReplies, prompts: dict[str, list[int]]) -> list:
    sent: list = []
    scheduler = Scheduler(engine, SchedulerSettings(ctx=128, batch=2, kv_slots=2, scripted_replies=script),
                          lambda gateway, message: sent.append(message))
    for rid, prompt in prompts.items():  # one at a time, so the unkeyed turn order is the submit order
        scheduler.submit(b"gw", Generate(rid, prompt, SamplingParams(temperature=1.0, logprobs=True), 20))
        for _ in range(60):
            scheduler.admit()
            if not scheduler.running:
                break
            scheduler.step()
    return sent


def tokens(sent: list, rid: str) -> list[int]:
    return [t for m in sent if isinstance(m, Tokens) and m.request_id == rid for t in m.ids]


def test_replies_by_marker_and_in_turn_then_end_of_turn(engine, tmp_path):
    tokenizer = engine.tokenizer
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"when": "[[hi]]", "text": "Hello there"}, [5, 6, 7],
                                {"when": "[[bye]]", "ids": [9]}, {"ids": [8]}]))
    script = ScriptedReplies.load(path, tokenizer)
    end = end_of_turn_id(tokenizer)
    assert end in tokenizer.stop_ids
    sent = run(engine, script, {
        "plain-1": [1, 2, 3],
        "hi": tokenizer.encode("say [[bye]] then [[hi]]", add_special=False),  # the later marker wins
        "plain-2": [1, 2, 3],
        "plain-3": [1, 2, 4],
    })
    assert tokens(sent, "hi") == tokenizer.encode("Hello there", add_special=False) + [end]
    assert tokens(sent, "plain-1") == [5, 6, 7, end]
    assert tokens(sent, "plain-2") == [8, end]
    assert tokens(sent, "plain-3") == [5, 6, 7, end]  # the unkeyed replies cycle
    assert all(m.reason == "stop" for m in sent if isinstance(m, Finished))

    # the logprob reported for a scripted token is the real model's
    first = next(m for m in sent if isinstance(m, Tokens) and m.request_id == "plain-1")
    logits = engine.prefill(engine.new_cache(16), [1, 2, 3])
    assert first.logprobs[0] == pytest.approx(float(ops.log_softmax(logits.astype(np.float64))[5]), abs=1e-4)


def test_then_sample_goes_on_with_the_model_after_the_script(engine, tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"ids": [5, 6], "then": "sample"}, [7]]))
    script = ScriptedReplies.load(path, engine.tokenizer)
    sent = run(engine, script, {"sampled": [1, 2, 3], "ended": [1, 2, 3]})
    end = end_of_turn_id(engine.tokenizer)
    sampled = tokens(sent, "sampled")
    # the scripted pair, then the model's own tokens until max_tokens (20) or its end of turn
    assert sampled[:2] == [5, 6] and len(sampled) > 2, sampled
    finish = next(m for m in sent if isinstance(m, Finished) and m.request_id == "sampled")
    assert (finish.reason, len(sampled)) == ("length", 20) or sampled[-1] in engine.tokenizer.stop_ids
    assert tokens(sent, "ended") == [7, end]


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read"),
    ('{"text": "x"}', "JSON list"),
    ("[]", "no replies"),
    ('[{"text": "x", "ids": [1]}]', "'text' or 'ids'"),
    ('[["a"]]', "integer token ids"),
    ('[[99999999]]', "outside"),
    ('[{"text": "x", "when": ""}]', "'when'"),
    ('[{"text": "x", "then": "stop"}]', "'then'"),
])
def test_a_bad_script_is_refused_with_a_clear_message(engine, tmp_path, content, message):
    path = tmp_path / "script.json"
    path.write_text(content)
    with pytest.raises(LmserveError, match=message):
        ScriptedReplies.load(path, engine.tokenizer)
