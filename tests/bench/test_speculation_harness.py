"""bench.serve --speculation: the edit and free-prose workloads, the four server variants, the
acceptance a stream reports, the ratios the report computes from given figures, and the whole
run against lmserve on a tiny model (llama-server is not built in tests: its variants are only
checked as command lines)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import report, serve, streams, workload
from bench.measure import RepeatFigures
from bench.servers import (
    LMSERVE,
    PEER,
    PEER_NGRAM,
    PEER_OFF,
    PEER_ON,
    SPEC_OFF,
    SPEC_ON,
    lmserve_spec,
    peer_spec,
    speculation_variants,
)
from bench.streams import StreamResult
from bench.workload import EDIT_QUICK, EditPlan


def words(text: str) -> int:
    return len(text.split())


def test_the_edit_source_is_whole_lines_within_its_budget(tmp_path):
    lines = ['"""A module."""\n', "\n", "import os\n", "\n", "async def load_config(path):\n",
             "    return os.path.exists(path)\n", "\n", "def later():\n", "    pass\n"]
    (tmp_path / "m.py").write_text("".join(lines))
    source = workload.edit_source(EditPlan(str(tmp_path / "m.py"), 9, 16, 8), words)
    assert source.text == "".join(lines[:7]) and source.tokens == 9  # the next line would pass 9 words
    assert source.function == "load_config" and source.path == "m.py"
    assert source.digest == workload.edit_source(EditPlan(str(tmp_path / "m.py"), 9, 16, 8), words).digest
    (message,) = workload.edit_messages(source)
    assert source.text in message["content"] and "`load_config` to `load_config_v2`" in message["content"]


def test_the_default_edit_source_is_a_file_of_this_repository():
    source = workload.edit_source(EDIT_QUICK, words)
    assert source.path == EDIT_QUICK.source and 0 < source.tokens <= EDIT_QUICK.source_tokens
    assert source.text and (REPO / source.path).read_text().startswith(source.text)


def test_copied_share_counts_the_reply_lines_found_in_the_file():
    source = "def f():\n    return 1\n"
    assert workload.copied_share(source, "```python\ndef f():\n    return 1\n```") == pytest.approx(2 / 4)
    assert workload.copied_share(source, "def f():\n\n  return 1") == 1.0
    assert workload.copied_share(source, "\n \n") is None


def test_acceptance_is_read_from_lmserve_usage_and_llama_server_timings():
    ours = StreamResult(started=0.0)
    streams.apply_chat_chunk(ours, {"choices": [], "usage": {"completion_tokens": 9, "speculation": {
        "drafted_tokens": 40, "accepted_tokens": 30}}}, 1.0)
    assert (ours.tokens, ours.drafted, ours.accepted, ours.acceptance) == (9, 40, 30, 0.75)
    short = StreamResult(started=0.0)  # the shorter spelling of the same extension
    streams.apply_chat_chunk(short, {"choices": [], "usage": {"speculation": {"drafted": 4, "accepted": 1}}}, 1.0)
    assert short.acceptance == 0.25
    theirs = StreamResult(started=0.0)
    streams.apply_chat_chunk(theirs, {"choices": [{"delta": {}, "finish_reason": "length"}],
                                      "timings": {"predicted_n": 9, "draft_n": 10, "draft_n_accepted": 9}}, 1.0)
    assert (theirs.drafted, theirs.accepted, theirs.acceptance) == (10, 9, 0.9)
    plain = StreamResult(started=0.0)
    streams.apply_chat_chunk(plain, {"choices": [], "usage": {"completion_tokens": 3},
                                     "timings": {"predicted_n": 3}}, 1.0)
    assert (plain.drafted, plain.accepted, plain.acceptance) == (None, None, None)


def test_the_variants_are_the_spec_flags_of_each_server():
    variants = speculation_variants(6, ["--spec-type", "ngram-map-k"])
    assert [(v.name, v.server, v.flags) for v in variants] == [
        (SPEC_OFF, LMSERVE, ("--spec", "off")),
        (SPEC_ON, LMSERVE, ("--spec", "ngram", "--spec-max", "6")),
        (PEER_OFF, PEER, ()),
        (PEER_ON, PEER, ("--spec-type", "ngram-map-k"))]
    assert [v.name for v in speculation_variants(8, servers=[LMSERVE])] == [SPEC_OFF, SPEC_ON]
    assert speculation_variants(8)[3].flags == PEER_NGRAM
    assert lmserve_spec("m.gguf", 1024, 1, 2, extra=("--spec", "off")).command[-2:] == ["--spec", "off"]
    command = peer_spec(Path("/bin"), "m.gguf", 1024, 1, 2, PEER_NGRAM).command
    assert command[0] == "/bin/llama-server" and command[-len(PEER_NGRAM):] == list(PEER_NGRAM)


def _figures() -> dict[str, list[RepeatFigures]]:
    def repeat(edit: float, prose: float, accepted: float | None = None) -> RepeatFigures:
        return RepeatFigures({"edit|decode": edit, "prose|decode": prose, "edit|acceptance": accepted})

    return {SPEC_OFF: [repeat(60, 100), repeat(62, 104), repeat(58, 96)],
            SPEC_ON: [repeat(150, 98, 0.9), repeat(140, 95, 0.8), repeat(160, 101, 0.85)],
            PEER_OFF: [repeat(70, 110), repeat(75, 115), repeat(65, 105)],
            PEER_ON: [repeat(100, 120, 0.95), repeat(130, 118, 0.9), repeat(120, 122, 1.0)]}


def test_the_ratios_are_medians_over_medians_held_to_their_targets():
    rows = report.build_speculation_rows(EDIT_QUICK, _figures(), source_tokens=290)
    assert [(r.scenario, r.metric) for r in rows] == [
        ("edit: ~290-token file back, 64 tokens", "decode"), ("edit: ~290-token file back, 64 tokens",
                                                              "drafts that stood"),
        ("free prose, 32 tokens", "decode")]  # nobody reported prose acceptance: no row
    assert rows[1].values == {SPEC_OFF: [], SPEC_ON: [0.9, 0.8, 0.85], PEER_OFF: [], PEER_ON: [0.95, 0.9, 1.0]}
    ratios = report.speculation_ratios(rows)
    assert [(name.split(":")[0], value, target) for name, value, target in ratios] == [
        ("edit", pytest.approx(150 / 70), 2.0), ("edit", pytest.approx(150 / 120), 1.3),
        ("prose", pytest.approx(98 / 100), 0.95)]
    lines = report.format_speculation_ratios(ratios).splitlines()
    assert "2.14x  target >= 2.00: meets" in lines[0]
    assert "1.25x  target >= 1.30: MISSES" in lines[1]
    assert "0.98x  target >= 0.95: meets" in lines[2]
    # without llama-server in the run its ratios are not computed
    alone = report.speculation_ratios(report.build_speculation_rows(
        EDIT_QUICK, {k: v for k, v in _figures().items() if k in (SPEC_OFF, SPEC_ON)}))
    assert [value for _, value, _ in alone] == [None, None, pytest.approx(0.98)]
    assert report.format_speculation_ratios(alone).splitlines()[0].endswith("target >= 2.00: n/a")


def test_the_results_file_reprints_the_same_table(tmp_path, capsys):
    out = tmp_path / "speculation.json"
    meta = {"model": "m.gguf", "threads": 2, "edit_source": {"path": "worker/stream.py", "tokens": 290,
                                                            "digest": "abc"}}
    document = report.write_speculation_results(out, EDIT_QUICK, _figures(), meta)
    assert json.loads(out.read_text()) == json.loads(json.dumps(document))
    assert document["servers"] == [SPEC_OFF, SPEC_ON, PEER_OFF, PEER_ON]
    assert [r["target"] for r in document["ratios"]] == [2.0, 1.3, 0.95]
    report.print_speculation_report(document)
    printed = capsys.readouterr().out
    assert serve.main(["--render", str(out)]) == 0
    assert capsys.readouterr().out == printed
    assert "edit source worker/stream.py (290 tokens" in printed and "1.25x  target >= 1.30: MISSES" in printed


def test_the_comparison_runs_against_lmserve_on_a_tiny_model(tmp_path, capsys):
    model = tmp_path / "llama.gguf"
    write_tiny_gguf(model, "llama", context_length=1024)
    out = tmp_path / "speculation.json"
    assert serve.main(["--speculation", "--quick", "--servers", LMSERVE, "--model", str(model), "--ctx", "1024",
                       "--parallel", "1", "--spec-max", "4", "--quiet", "-1", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["servers"] == [SPEC_OFF, SPEC_ON]
    assert document["meta"]["server_commands"][SPEC_ON][-4:] == ["--spec", "ngram", "--spec-max", "4"]
    for variant in (SPEC_OFF, SPEC_ON):
        (checks,) = document["meta"]["checks"][variant]
        assert checks["edit exact length"] and checks["prose exact length"]
        assert checks["edit prompt tokens"] > document["meta"]["edit_source"]["tokens"]
    decode = {r["scenario"].split(":")[0].split(",")[0]: r for r in document["rows"] if r["metric"] == "decode"}
    assert all(decode[w]["servers"][v]["n"] == 1 for w in ("edit", "free prose") for v in (SPEC_OFF, SPEC_ON))
    ratios = {r["name"].split(":")[0]: r["ratio"] for r in document["ratios"]}
    assert ratios["prose"] > 0
    assert "prose: lmserve+spec / lmserve without speculation" in capsys.readouterr().out
