"""`pip install -e .`, README's first command, brings what serving needs and nothing more: no
torch (its default wheel is a CUDA build of several GB; lmserve[train] asks for it) and no test
tool. The serving entry points import in a fresh interpreter that cannot see what the base
dependencies do not bring, as in a lean venv (README gives its measured size and install time)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata

from conftest import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# what `lmserve serve` runs: the launcher, and the worker and gateway it starts
ENTRY_POINTS = ("launcher.cli", "launcher.serve", "worker.main", "gateway.main")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(text).name) for text in requirements}


def _brought_by(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, theirs included, as this venv resolved them."""
    found: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        extras = {""} | requirement.extras
        if (name, frozenset(extras)) in found:
            continue
        found.add((name, frozenset(extras)))
        try:
            below = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(text), wanted) for text in below for wanted in extras]
    return {name for name, _ in found}


def test_base_dependencies_leave_out_torch_and_the_test_tools():
    project = _project()
    base = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "torch" in _names(extras["train"]) and "torch" not in base
    assert not base & _names(extras["test"]), "a test tool is a base dependency"
    assert "torch" not in _brought_by(project["dependencies"]), "a base dependency brings torch"


def _outside_base() -> set[str]:
    """Top-level modules of the distributions in this venv that the base dependencies do not
    bring (the test extra's, the train extra's, pip's own)."""
    allowed = _brought_by(_project()["dependencies"]) | {"lmserve"}
    return {module for module, owners in metadata.packages_distributions().items()
            if not {canonicalize_name(owner) for owner in owners} & allowed}


# Imports ``modules`` in a fresh interpreter where the modules named in argv[1] cannot be found,
# as in a lean venv (an optional import, like anyio's of sniffio, then takes its fallback); prints
# the top-level modules that importing them loaded.
LEAN_IMPORT = """
import importlib, json, sys
hidden = set(json.loads(sys.argv[1]))
class LeanVenv:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r} in a lean install", name=name)
sys.meta_path.insert(0, LeanVenv())
before = set(sys.modules)
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps(sorted({name.partition(".")[0] for name in set(sys.modules) - before})))
"""


def _import_lean(*modules: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LEAN_IMPORT, json.dumps(sorted(_outside_base())), *modules],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_serving_entry_points_import_with_only_the_base_dependencies():
    result = _import_lean(*ENTRY_POINTS)
    assert result.returncode == 0, f"serving needs what a lean install lacks:\n{result.stderr[-2000:]}"
    imported = set(json.loads(result.stdout))
    assert {"fastapi", "uvicorn", "numba", "zmq"} <= imported and "torch" not in imported


def test_the_lean_import_check_sees_a_test_tool():
    """The check above, held to a module only the test extra brings, beside a base dependency."""
    hidden = _outside_base()
    assert {"torch", "selenium", "pytest"} <= hidden and not {"fastapi", "fastapi_offline", "yaml"} & hidden
    result = _import_lean("fastapi", "selenium.webdriver")
    assert result.returncode != 0 and "No module named 'selenium' in a lean install" in result.stderr


def test_the_supervising_process_imports_no_serving_stack():
    """``lmserve serve`` itself only starts and watches its children: its memory is part of the
    stack's, so it imports neither the engine's nor the HTTP server's libraries."""
    code = ("import sys, launcher.cli, launcher.serve\n"
            "from shared.default_model import resolve_model\n"
            "print(sorted(sys.modules))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                           check=True).stdout.replace("'", '"')))
    heavy = {"numpy", "numba", "jinja2", "tokenizers", "prometheus_client", "fastapi", "uvicorn", "llguidance",
             "huggingface_hub", "gateway.app", "worker.engine"}
    assert "launcher.serve" in loaded and not heavy & loaded, heavy & loaded
