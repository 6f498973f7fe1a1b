"""README.md's two opening commands stay true: CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```sh\n(.*?)\n```", text, re.S)[:2]


def test_readme_opens_with_the_install_and_test_commands():
    install, test = _readme_commands()
    assert install.endswith("lmserve serve")
    assert "pytest" in test
    # both start from nothing: a fresh venv and an editable install
    assert install.startswith("python3 -m venv .venv") and test.startswith("python3 -m venv .venv")
    # serving takes no extra (the test extra brings torch, a CUDA build of several GB);
    # tests/test_packaging.py holds the base dependencies to what serving needs
    assert " .venv/bin/pip install -q -e . && " in install and "[" not in install
    assert "-e '.[test]'" in test


def test_ci_runs_the_readme_test_command():
    _, test = _readme_commands()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines
