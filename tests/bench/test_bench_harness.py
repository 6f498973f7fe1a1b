"""The serving benchmark's pure parts: statistics, stream parsing, the table and its JSON.

No server is started and nothing is timed here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import measure, memory, peer, report, streams, workload
from bench.__main__ import command
from bench.measure import RepeatFigures
from bench.report import Row, Spread
from bench.servers import LMSERVE, PEER
from bench.streams import SseParser, StreamResult
from bench.workload import FULL


def test_percentile_and_spread() -> None:
    assert measure.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert measure.percentile([5.0], 95) == 5.0
    assert measure.percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    with pytest.raises(ValueError):
        measure.percentile([], 50)
    assert report.spread([3.0, None, 1.0, 2.0]) == Spread(1.0, 2.0, 3.0, 3)
    assert report.spread([None]) is None
    assert report.ratio(Spread(1, 4, 5, 3), Spread(1, 2, 3, 3)) == 2.0
    assert report.ratio(Spread(1, 4, 5, 3), None) is None
    assert report.ratio(Spread(1, 4, 5, 3), Spread(0, 0, 0, 1)) is None


def test_cells() -> None:
    assert report.format_cell(Spread(10.0, 12.5, 14.0, 3)) == "12.5 (10.0-14.0)"
    assert report.format_cell(Spread(1234.0, 1234.0, 1234.0, 1)) == "1234"
    assert report.format_cell(None, "not served") == "not served"
    assert report.format_cell(None) == "n/a"
    assert report.format_ratio(0.5) == "0.50x"
    assert report.format_ratio(None) == ""


def _rows() -> list[Row]:
    a = Row("short+256, 1 stream", "decode per stream", "tok/s", report.HIGHER,
            {LMSERVE: [30.0, 32.0, 31.0], PEER: [100.0, 110.0, 105.0]})
    b = Row("claude-code", "time to first token", "ms", report.LOWER, {LMSERVE: [900.0], PEER: []},
            {PEER: "not served"})
    return [a, b]


def test_row_ratio_and_tables() -> None:
    a, b = _rows()
    assert a.ratio() == pytest.approx(31.0 / 105.0)
    assert b.ratio() is None
    text = report.format_text_table([a, b])
    lines = text.splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert "not served" in lines[3] and "31.0 (30.0-32.0)" in lines[2]
    markdown = report.format_markdown_table([a, b]).splitlines()
    assert len(markdown) == 4
    assert all(line.startswith("|") and line.endswith("|") for line in markdown)
    assert len({line.count("|") for line in markdown}) == 1  # every line has the same columns


def test_one_server_table_has_no_ratio_column() -> None:
    header, first, _ = report.table_rows(_rows(), [LMSERVE])
    assert header == ["figure", f"{LMSERVE} median (min-max)", "better"]
    assert first == ["short+256, 1 stream: decode per stream (tok/s)", "31.0 (30.0-32.0)", report.HIGHER]


def test_results_json_shape() -> None:
    doc = report.results_json(_rows(), {"repeats": 3})
    doc = json.loads(json.dumps(doc))  # plain JSON through and through
    assert doc["format"] == 1 and doc["servers"] == [LMSERVE, PEER] and doc["meta"] == {"repeats": 3}
    first, second = doc["rows"]
    assert set(first) == {"scenario", "metric", "unit", "better", "servers", "ratio"}
    assert first["servers"][LMSERVE] == {"values": [30.0, 32.0, 31.0], "min": 30.0, "median": 31.0,
                                         "max": 32.0, "n": 3}
    assert second["servers"][PEER] == {"values": [], "note": "not served"}
    assert second["ratio"] is None
    assert doc["markdown"].startswith("| figure |")


def test_rows_come_back_from_the_json() -> None:
    doc = json.loads(json.dumps(report.results_json(_rows(), {})))
    back = report.rows_from_json(doc)
    assert [(r.label, r.values, r.note) for r in back] == [(r.label, r.values, r.note) for r in _rows()]


def test_load_summary() -> None:
    meta = {"machine": {"cores": 2}, "checks": {LMSERVE: [{"other cores per scenario": {"a": 0.0, "b": 1.5}}],
                                                PEER: [{"other cores per scenario": {"a": 0.1}}]}}
    assert report.load_summary(meta) == ("load from other processes during the scenarios: 0.10 cores median, "
                                        "1.50 max (of 2); 1 of 3 scenario runs had more than 0.25 cores of it")
    assert report.load_summary({}) is None


def test_sse_parser() -> None:
    parser = SseParser()
    lines = [": ping", "event: message_start", 'data: {"a": 1}', "", "", "data: [DONE]", ""]
    events = [e for e in (parser.feed(line) for line in lines) if e is not None]
    assert events == [("message_start", '{"a": 1}'), (None, "[DONE]")]
    parser.feed("data: {}")
    assert parser.close() == (None, "{}")
    assert parser.close() is None


def test_chat_chunks_skip_the_role_chunk() -> None:
    r = StreamResult(started=10.0)
    streams.apply_chat_chunk(r, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 10.1)
    streams.apply_chat_chunk(r, {"choices": [{"delta": {"content": "Hi"}}]}, 10.5)
    streams.apply_chat_chunk(r, {"choices": [{"delta": {"content": " there"}, "finish_reason": "length"}]}, 10.7)
    assert r.ttft == pytest.approx(0.5)
    assert r.gaps() == [pytest.approx(0.2)]
    assert r.text == "Hi there" and r.finish_reason == "length"
    # no usage: a stream that ended on length made max_tokens tokens; otherwise count chunks
    assert r.output_tokens(16) == 16 and r.output_tokens() == 2
    streams.apply_chat_chunk(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                                        "prompt_tokens_details": {"cached_tokens": 4}}}, 10.8)
    assert (r.tokens, r.prompt_tokens, r.cached_tokens) == (3, 9, 4)
    assert r.decode_rate() == pytest.approx(2 / 0.2)
    with pytest.raises(RuntimeError):
        streams.apply_chat_chunk(r, {"error": {"message": "boom"}}, 11.0)


def test_messages_events() -> None:
    r = StreamResult(started=0.0)
    streams.apply_messages_event(r, "message_start", {"type": "message_start", "message": {
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 90}}}, 0.1)
    streams.apply_messages_event(r, "content_block_delta", {"type": "content_block_delta",
                                                          "delta": {"type": "text_delta", "text": ""}}, 0.2)
    streams.apply_messages_event(r, "content_block_delta", {"type": "content_block_delta",
                                                          "delta": {"type": "text_delta", "text": "ok"}}, 0.3)
    streams.apply_messages_event(r, "message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                                    "usage": {"output_tokens": 1}}, 0.4)
    assert r.ttft == pytest.approx(0.3)
    assert (r.prompt_tokens, r.cached_tokens, r.tokens, r.finish_reason) == (100, 90, 1, "end_turn")
    assert r.decode_rate() is None  # one token has no decode interval


def test_build_rows_marks_what_a_server_lacks() -> None:
    ours = RepeatFigures({"short c=1|decode": 30.0, "claude-code|ttft first": 5000.0, "memory|chat": 700.0})
    theirs = RepeatFigures({"short c=1|decode": 100.0, "memory|chat": 600.0})
    notes = {PEER: {"claude-code": "not served (no /v1/messages)"}}
    rows = report.build_rows(FULL, {LMSERVE: [ours, ours], PEER: [theirs, theirs]}, notes)
    by_metric = {(r.scenario.split(",")[0], r.metric): r for r in rows}
    decode = by_metric[("short+256", "decode per stream")]
    assert decode.values == {LMSERVE: [30.0, 30.0], PEER: [100.0, 100.0]} and decode.ratio() == 0.3
    cc = next(r for r in rows if r.scenario.startswith("claude-code") and "turn 1" in r.metric)
    assert cc.note == {PEER: "not served (no /v1/messages)"} and cc.ratio() is None
    assert len(rows) == 3  # figures nobody measured are left out


def test_sized_text_hits_the_target() -> None:
    def words(text: str) -> int:
        return len(text.split())

    text = workload.sized_text(words, 300, seed=1, head="Start here.")
    assert text.startswith("Start here.") and 280 <= words(text) <= 300
    assert workload.sized_text(words, 300, seed=1, head="Start here.") == text  # deterministic


def test_entry_point_commands() -> None:
    assert command("serve", quick=True, repeats=None)[1:] == ["-m", "bench.serve", "--quick"]
    assert command("worker", quick=True, repeats=3)[1:] == ["-m", "bench.worker", "--tokens", "16", "--repeats", "3"]
    assert command("grammar", quick=True, repeats=2)[1:] == ["-m", "bench.grammar"]


def test_peer_sanity_line() -> None:
    assert "plausible" in peer.peer_sanity_line(90.0)
    assert "TOO LOW" in peer.peer_sanity_line(20.0)


def test_the_peer_kernels_are_held_to_the_reference_of_their_path() -> None:
    # AMX only counts where the CPU has it and the build keeps it
    assert peer.kernel_path(True, "") == "AMX int8"
    assert peer.kernel_path(True, "-DCMAKE_C_FLAGS=-mno-amx-int8") == "without AMX"
    assert peer.kernel_path(False, "") == "without AMX"
    refs = {k: list(v) for k, v in peer.KERNEL_REFERENCES["without AMX"].items()}
    good = peer.peer_kernel_line({"pp512": 257.0, "tg128": 106.0, "path": "without AMX", "references": refs})
    assert "within 15%" in good and "pp512 257 (reference 200-250)" in good
    slow = peer.peer_kernel_line({"pp512": 120.0, "tg128": 95.0, "path": "without AMX", "references": refs})
    assert "TOO SLOW in pp512:" in slow and "do not trust" in slow
    fast = peer.peer_kernel_line({"pp512": 316.0, "tg128": 137.0, "path": "without AMX", "references": refs})
    assert "faster than the reference in pp512, tg128" in fast
    # llama.cpp's figures are for the default model: another file is measured, not judged
    other = peer.peer_kernel_line({"pp512": 569.0, "tg128": 59.0, "path": "without AMX", "references": None})
    assert "pp512 569; tg128 59" in other and "no reference" in other and "TOO SLOW" not in other


def test_the_peer_server_is_read_against_its_own_kernels_when_measured() -> None:
    line = peer.peer_sanity_line(75.5, {"tg128": 137.0})
    assert "75.5 tok/s, 55% of its kernels' tg128 (137 tok/s)" in line


def test_the_summary_reads_each_files_ratios_and_the_first_start() -> None:
    import dataclasses

    plan = dataclasses.replace(FULL, concurrency=(1, 4), longest_prompt=16000)
    repeats = {LMSERVE: [RepeatFigures({"long cold|prefill": 300.0, "short c=1|decode": 60.0,
                                        "short c=4|aggregate": 150.0, "memory|pss": 500.0, "start|warm": 3.0,
                                        "start|cold": 24.0, "longest cold|ttft": 100_000.0})],
               PEER: [RepeatFigures({"long cold|prefill": 100.0, "short c=1|decode": 50.0,
                                     "short c=4|aggregate": 100.0, "memory|pss": 600.0, "start|warm": 1.0,
                                     "longest cold|ttft": 400_000.0})]}
    rows = report.build_rows(plan, repeats, {})
    document = report.results_json(rows, {"model": "m.gguf", "plan": dataclasses.asdict(plan)}, [LMSERVE, PEER])
    document = json.loads(json.dumps(document))  # as read back from the file
    assert report.medians(document, "long cold|prefill") == (300.0, 100.0, "tok/s")
    assert report.medians(document, "short c=4|aggregate") == (150.0, 100.0, "tok/s")
    assert report.medians(document, "start|cold") == (24.0, None, "s")
    table = report.summary_table([document])
    assert "| m.gguf | 300 / 100 tok/s = 3.00 |" in table
    assert "= 0.25" in table and "= 0.83" in table and table.rstrip().endswith("| 24.0 s |")


def test_memory_is_read_per_process_and_named_by_its_part() -> None:
    import os

    rss, pss = memory.process_memory(os.getpid())
    assert 0 < pss <= rss
    assert memory.process_memory(2**31 - 7) is None
    python = "/venv/bin/python"
    assert memory.process_role([python, "-m", "launcher.supervised", "1", "worker", "--ctx"]) == "worker"
    assert memory.process_role([python, "-m", "launcher.supervised", "1", "gateway"]) == "gateway"
    assert memory.process_role([python, "-m", "launcher.cli", "serve", "m.gguf"]) == "launcher"
    assert memory.process_role(["/build/bin/llama-server", "-m", "m.gguf"]) == "llama-server"


def test_settle_waits_until_the_server_tree_stops_computing(tmp_path):
    """A first start's compiling goes on after it answers: ``settle`` returns only once the
    process tree is idle (here a child that computes, then writes a file and sleeps)."""
    import subprocess
    import sys

    from bench.servers import settle, stop_server
    done = tmp_path / "done"
    script = ("import time, pathlib\nend = time.monotonic() + 2.5\nwhile time.monotonic() < end: pass\n"
              f"pathlib.Path({str(done)!r}).write_text('x')\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        settle(proc, timeout=30)
        assert done.exists(), "settle returned while the process still computed"
    finally:
        stop_server(proc)


def test_the_bench_process_prepares_its_prompts_without_loading_llvm(default_model):
    """Pages of LLVM's library that the bench's own process maps stay resident in the worker it
    measures (the worker's page-out after its warm-up cannot drop pages another process maps),
    and half of them counted in the stack's PSS: 21 MiB of gemma-3-270m's figure. Preparing the
    workload and the machine's facts leaves numba and llvmlite unloaded."""
    import subprocess

    script = ("import sys\nfrom bench.workload import FULL, Workload\nfrom bench.machine import machine_facts\n"
              f"work = Workload({str(default_model)!r}, FULL)\n"
              "assert work.count('hello world') > 0\n"
              "assert machine_facts()['lmserve_gemm'] in ('vectors', 'AMX tiles for 16-row blocks')\n"
              "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
