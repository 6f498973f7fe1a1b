"""Model-load progress: measured by the worker, shown as a bar on a terminal.

The worker reports how many weight bytes it has read. Run alone on a terminal it draws the bar
itself; under ``lmserve serve`` it writes JSON lines to a pipe (``--status-fd``) instead, so the
parent can draw one bar for the whole stack and learn the moment the model is loaded:

    {"event": "loading", "done": 123, "total": 456}
    {"event": "ready", "model": "SmolLM2-135M-Instruct", "endpoint": "tcp://127.0.0.1:5557"}
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TextIO

BAR_WIDTH = 30
REPAINT_INTERVAL = 0.1  # seconds; a bar repainted per tensor would flood a slow terminal


class StatusWriter:
    """The worker's end of the status pipe."""

    def __init__(self, fd: int):
        self.stream = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def _send(self, entry: dict[str, Any]) -> None:
        try:
            self.stream.write(json.dumps(entry) + "\n")
        except (BrokenPipeError, ValueError):
            pass  # nobody is listening any more; the worker carries on regardless

    def loading(self, done: int, total: int) -> None:
        self._send({"event": "loading", "done": done, "total": total})

    def compiling(self, what: str) -> None:
        """A first start on this CPU compiles kernels (``what``: for a person) before serving."""
        self._send({"event": "compiling", "what": what})

    def ready(self, model: str, endpoint: str) -> None:
        self._send({"event": "ready", "model": model, "endpoint": endpoint})

    def close(self) -> None:
        try:
            self.stream.close()
        except BrokenPipeError:
            pass


def parse_status(line: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and "event" in entry else None


def megabytes(done: int, total: int) -> str:
    return f"{done / 1e6:.0f}/{total / 1e6:.0f} MB"


class ProgressBar:
    """One line redrawn in place: ``loading model.gguf [#####-----]  48%  45/93 MB``. Where the
    stream is not a terminal (``redraw`` off), a whole line at every tenth instead."""

    def __init__(self, stream: TextIO, label: str, amount: Callable[[int, int], str] = megabytes,
                 redraw: bool = True):
        self.stream = stream
        self.label = label
        self.amount = amount  # how done/total reads after the percentage
        self.redraw = redraw
        self.last_paint = 0.0
        self.painted = False
        self.tenths = -1  # without redraw: the last tenth printed

    def update(self, done: int, total: int, note: str = "") -> None:
        now = time.monotonic()
        fraction = min(done / total, 1.0) if total else 0.0
        if self.redraw and now - self.last_paint < REPAINT_INTERVAL and done < total:
            return
        if not self.redraw and int(fraction * 10) <= self.tenths:
            return
        self.last_paint, self.tenths = now, int(fraction * 10)
        filled = int(fraction * BAR_WIDTH)
        line = (f"{self.label} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] "
                f"{fraction * 100:3.0f}%  {self.amount(done, total)}{'  ' + note if note else ''}")
        self.stream.write(f"\r{line}" if self.redraw else f"{line}\n")
        self.stream.flush()
        self.painted = self.redraw

    def finish(self) -> None:
        if self.painted:
            self.stream.write("\n")
            self.stream.flush()
            self.painted = False
