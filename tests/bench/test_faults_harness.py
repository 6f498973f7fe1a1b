"""The fault benchmark's judgements, on canned replies: what is an envelope, what counts as a
cut that looked finished. No stack is started here (``python -m bench.faults`` does that)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.faults import CHAT, COUNT, MESSAGES, RESPONSES, Outcome, Row, exceptions, is_envelope, table


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_openai_envelopes(path):
    assert is_envelope(path, {"error": {"message": "m", "type": "invalid_request_error", "param": None}})
    assert not is_envelope(path, {"detail": "Not Found"})  # FastAPI's default shape
    assert not is_envelope(path, "Invalid HTTP request received.")
    assert not is_envelope(path, {"error": "m"})


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
def test_anthropic_envelopes(path):
    assert is_envelope(path, {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}})
    assert not is_envelope(path, {"error": {"type": "invalid_request_error", "message": "m"}})  # no type: error


def test_a_finished_stream_counts_as_a_disguised_cut_only_where_a_cut_was_due():
    finished = Outcome(status=200, stream=True, finished=True)
    errored = Outcome(status=200, stream=True, errored=True)
    row = Row("kill")
    row.count(finished, cut_expected=True)
    row.count(errored, cut_expected=True)
    row.count(finished)
    assert (row.tries, row.cut_looking_finished) == (3, 1)
    assert not row.clean


def test_hangs_and_server_errors_are_counted_and_503_only_where_a_process_is_down():
    row, killing = Row("x"), Row("y", unavailable_ok=True)
    for status in (None, 500, 503, 400, 0):
        row.count(Outcome(status=status))
        killing.count(Outcome(status=status))
    assert (row.hangs, row.server_errors, killing.server_errors) == (1, 2, 1)
    assert "| x | 5 | 2 | 1 | 0 | 0 |" in table([row])


def test_a_logs_tracebacks_are_reduced_to_their_exceptions():
    log = ["INFO fine", "ERROR Exception in ASGI application", "Traceback (most recent call last):",
           '  File "x.py", line 1, in f', "    raise KeyError(1)", "KeyError: 1", "",
           "During handling of the above exception, another exception occurred:", "",
           "Traceback (most recent call last):", '  File "y.py", line 2', "RuntimeError: boom", "INFO after"]
    assert exceptions(log) == ["KeyError: 1", "RuntimeError: boom"]
