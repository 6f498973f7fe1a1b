"""Reading back what a gateway logged with ``--log-format json``."""

from __future__ import annotations

import json
from pathlib import Path


def access_entries(log_path: Path, dialects_only: bool = False) -> list[dict]:
    """The gateway's access-log entries, in order; with ``dialects_only``, just API requests."""
    entries = []
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line another process wrote, or a text-format line
        if isinstance(entry, dict) and entry.get("logger") == "lmserve.access" \
                and (entry.get("dialect") or not dialects_only):
            entries.append(entry)
    return entries
