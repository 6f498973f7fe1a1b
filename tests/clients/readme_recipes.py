"""The recipes of README.md's "Use it with…" section, read as the client tests run them, so the
README says what the tests do."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "\n## Use it with"
LOCAL_URL = "http://127.0.0.1:8080"  # where the recipes expect the server


def blocks(language: str, holding: str = "") -> list[str]:
    """The section's code blocks in ``language`` that hold ``holding``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + 1)
    found = [block for block in re.findall(rf"```{language}\n(.*?)\n```", text[start:end], re.S) if holding in block]
    assert found, f"README.md's 'Use it with' section has no {language} block holding {holding!r}"
    return found


def exported(block: str) -> dict[str, str]:
    """The variables a shell block's ``export`` lines set."""
    pairs = [word.split("=", 1) for line in block.splitlines() if line.startswith("export ")
             for word in shlex.split(line, comments=True)[1:]]
    return dict(pairs)


def command(block: str, program: str) -> list[str]:
    """The block's first command line running ``program`` with arguments."""
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) > 1 and words[0] == program:
            return words
    raise AssertionError(f"the README block runs no {program} command with arguments:\n{block}")
