"""Log lines as readable text or as one JSON object per line (``--log-format``).

A record may carry structured fields in ``extra={"fields": {...}}``: text lines show its
message (which already says the same), JSON lines carry each field as a top-level key so a log
pipeline can index them without parsing the message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def add_log_format_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="log lines as readable text or as one JSON object per line")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(log_format: str, level: int = logging.INFO) -> None:
    """Send every logger's records (uvicorn's included) to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
