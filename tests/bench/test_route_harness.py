"""bench.route's arithmetic on canned results: what share of a conversation counts as cached,
and when a kill run is clean. No stack is started here (``python -m bench.route`` does that)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.route import KillFigures, Result, figures


def test_a_later_turn_is_measured_against_what_the_previous_one_left():
    results = [Result(0, 1, 0, "w0", prompt_tokens=1000, completion_tokens=24, ttft=3.0),
               Result(0, 2, 1, "w0", prompt_tokens=1300, cached_tokens=1024, completion_tokens=24, ttft=1.0),
               Result(1, 1, 1, "w1", prompt_tokens=1000, completion_tokens=24, ttft=5.0),
               Result(1, 2, 0, "w1", prompt_tokens=1300, cached_tokens=512, completion_tokens=24, ttft=2.0)]
    row = figures("prefix", results)
    assert row.worst == pytest.approx(512 / 1024) and row.mean == pytest.approx((1.0 + 0.5) / 2)
    assert (row.ttft_first, row.ttft_later) == (pytest.approx(4.0), pytest.approx(1.5))
    assert row.spread == {"w0": 2, "w1": 2} and row.errors == 0


def test_a_kill_run_is_clean_only_if_nothing_else_failed_and_the_worker_came_back():
    cut = Result(0, 2, 0, "w0", retried=True, cut_on="w1")
    assert KillFigures(cut=[cut], rejoined=3).clean
    assert not KillFigures(cut=[cut], rejoined=0).clean
    assert not KillFigures(failed_elsewhere=[Result(1, 2, 0, "w0", retried=True)], rejoined=3).clean
    assert not KillFigures(failed_finally=[Result(1, 2, 0, error="boom")], rejoined=3).clean
