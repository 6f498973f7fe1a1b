"""qwen35's multi-token-prediction block as a draft source, held to llama.cpp's ``draft-mtp``.

The fixtures (scripts/regen_mtp_fixtures.py) hold, for the tiny MTP models and two prompts,
llama-server's greedy reply and, for every draft round, the three best candidates of each of
its draft steps with their probabilities, how many drafts it verified and how many it kept.
Here the same rounds are replayed: the target verifies [token, drafts…] in one pass, keeps what
its argmax agrees with, and the MTP state is given the kept tokens with the target's final
states at them; every round's drafts must be llama.cpp's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_models import MTP_FIXTURES, write_tiny_gguf

from worker.engine.archs import load_model
from worker.engine.gguf_file import GGUFFile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DRAFT_TOP_K = 10  # llama.cpp's drafter samples from its top 10: its probabilities are over those
# The log prints probabilities to three decimals: every one of the 792 logged is ours rounded so,
# but for 7 at a rounding edge, one unit off (measured: max |Δp| 5.4e-4). A wrong input order or
# a missing norm moves the candidates themselves.
PROB_TOLERANCE = 7e-4


def mtp_fixture(name: str) -> dict:
    data = np.load(FIXTURES / f"mtp_drafts_{name}.npz")
    return {key: data[key] for key in data.files} | {"meta": json.loads(str(data["meta"]))}


@pytest.fixture(scope="module", params=sorted(MTP_FIXTURES))
def case(request, tmp_path_factory):
    name = request.param
    fixture = mtp_fixture(name)
    arch, overrides = MTP_FIXTURES[name]
    assert fixture["meta"]["model"]["overrides"] == json.loads(json.dumps(overrides)), "regenerate the fixture"
    path = tmp_path_factory.mktemp("mtp") / f"{name}.gguf"
    write_tiny_gguf(path, arch, seed=fixture["meta"]["model"]["seed"], **overrides)
    return name, fixture, load_model(GGUFFile(path), exact=True, kv_type="f32")


def candidates(model, state, token: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The three best ids [steps, 3] and their probabilities among the top 10 at each draft
    step, through ``mtp_forward`` as ``mtp_draft`` chains it; the state is left as it was."""
    start, hidden, ids, probs = state.cache.length, state.last_hidden, [], []
    for _ in range(steps):
        logits, states = model.mtp_forward(state.cache, [token], hidden[None, :])
        best = np.argpartition(-logits[0], DRAFT_TOP_K)[:DRAFT_TOP_K]
        order = best[np.argsort(-logits[0][best], kind="stable")]
        top = logits[0][order].astype(np.float64)
        p = np.exp(top - top[0])
        ids.append(order[:3])
        probs.append((p / p.sum())[:3])
        token, hidden = int(order[0]), states[0]
    state.cache.truncate(start)
    return np.asarray(ids), np.asarray(probs)


def replay(model, fixture: dict, k: int) -> list[float]:
    """Replay prompt k's rounds, asserting llama.cpp's drafts, verifications and reply; returns
    each candidate's |Δp|."""
    prompt, reply = fixture[f"prompt_{k}"].tolist(), fixture[f"reply_{k}"].tolist()
    steps = fixture[f"draft_ids_{k}"].shape[1]
    cache, state = model.new_cache(len(prompt) + len(reply) + steps + 1), model.new_mtp_state(64 + len(reply))
    hidden: list[np.ndarray] = []
    token = int(np.argmax(model.forward([(cache, prompt)], hidden_out=hidden)[0]))
    model.mtp_accept(state, prompt, hidden[0])
    kept, deltas = [token], []
    for r, (verified, accepted) in enumerate(zip(fixture[f"verified_{k}"], fixture[f"accepted_{k}"])):
        drafts = model.mtp_draft(state, token, steps)
        np.testing.assert_array_equal(drafts, fixture[f"draft_ids_{k}"][r, :, 0], err_msg=f"prompt {k} round {r}")
        ids, probs = candidates(model, state, token, steps)
        np.testing.assert_array_equal(ids, fixture[f"draft_ids_{k}"][r], err_msg=f"prompt {k} round {r}")
        deltas.extend(np.abs(probs - fixture[f"draft_probs_{k}"][r]).ravel())
        # the target verifies the token and the drafts the server sent (on a copy: its recurrent
        # states cannot be cut back), then keeps what it agrees with
        trial = model.new_cache(cache.max_tokens)
        trial.copy_prefix(cache, cache.length)
        batch = [token, *drafts[:verified]]
        logits = model.forward([(trial, batch)], all_logits=True)[0]
        agreed = 0
        while agreed < verified and drafts[agreed] == int(np.argmax(logits[agreed])):
            agreed += 1
        assert agreed == accepted
        new_token = int(np.argmax(logits[agreed]))
        hidden = []
        model.forward([(cache, batch[:agreed + 1])], hidden_out=hidden)
        model.mtp_accept(state, batch[:agreed + 1], hidden[0])
        kept += [*drafts[:agreed], new_token]
        token = new_token
    assert kept == reply[:len(kept)] and len(kept) >= len(reply) - 1
    return deltas


def test_drafts_are_llama_cpps(case):
    name, fixture, model = case
    deltas = []
    for k in range(fixture["meta"]["prompts"]["count"]):
        deltas += replay(model, fixture, k)
    assert max(deltas) < PROB_TOLERANCE, f"{name}: max |Δp| {max(deltas)}"


def test_the_state_is_left_as_it_was_and_the_trunk_is_untouched(case):
    """A draft leaves the MTP state as it found it, kept tokens given in one call or one by one
    give the same drafts, and ``hidden_out`` changes nothing of the logits."""
    _, fixture, model = case
    prompt = fixture["prompt_1"].tolist()
    cache, plain = model.new_cache(len(prompt)), model.new_cache(len(prompt))
    hidden: list[np.ndarray] = []
    logits = model.forward([(cache, prompt)], all_logits=True, hidden_out=hidden)[0]
    np.testing.assert_array_equal(logits, model.forward([(plain, prompt)], all_logits=True)[0])
    assert hidden[0].shape == (len(prompt), model.hp.n_embd)
    np.testing.assert_array_equal(hidden[0][-1], model.forward([(model.new_cache(len(prompt)), prompt)],
                                                               hidden=True)[0])
    whole, split = model.new_mtp_state(64), model.new_mtp_state(64)
    model.mtp_accept(whole, prompt, hidden[0])
    model.mtp_accept(split, prompt[:30], hidden[0][:30])
    for i in range(30, len(prompt)):
        model.mtp_accept(split, [prompt[i]], hidden[0][i:i + 1])
    token = int(np.argmax(logits[-1]))
    first = model.mtp_draft(whole, token, 4)
    assert whole.cache.length == len(prompt) and whole.cache.tokens == prompt
    assert model.mtp_draft(whole, token, 4) == first == model.mtp_draft(split, token, 4)
    # cut back and given the same tokens again: the same drafts
    whole.truncate(20, hidden[0][19])
    model.mtp_accept(whole, prompt[20:], hidden[0][20:])
    assert model.mtp_draft(whole, token, 4) == first


def test_a_file_without_mtp_layers_has_no_mtp_state(tmp_path):
    write_tiny_gguf(tmp_path / "plain.gguf", "qwen35")
    model = load_model(GGUFFile(tmp_path / "plain.gguf"), exact=True, kv_type="f32")
    assert model.mtp_layers == 0 and len(model.layers) == model.hp.n_layer
    with pytest.raises(ValueError, match="no MTP layers"):
        model.new_mtp_state(16)
