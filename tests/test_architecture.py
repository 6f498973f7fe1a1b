"""The rules of docs/ARCHITECTURE.md, read from the code itself: which process's package may
import which, and that no module reaches into another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

# package -> the packages of ours it may import (its own included)
MAY_IMPORT = {
    "shared": {"shared"},
    "kvstore": {"kvstore"},
    "gateway": {"gateway", "shared"},
    "worker": {"worker", "shared", "kvstore"},
    "launcher": {"launcher", "gateway", "worker", "shared", "kvstore"},
}
OURS = set(MAY_IMPORT) | {"bench", "scripts", "tests"}


def python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


def imported_packages(tree: ast.AST) -> dict[str, int]:
    """Our top-level packages a module imports, at any depth (function-level imports too),
    each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue  # a relative import stays inside its own package
        for name in names:
            top = name.split(".")[0]
            if top in OURS:
                found.setdefault(top, node.lineno)
    return found


def test_every_installed_package_has_import_rules():
    pyproject = (REPO / "pyproject.toml").read_text()
    installed = {path.parent.name for path in REPO.glob("*/__init__.py") if f'"{path.parent.name}*"' in pyproject}
    assert installed == set(MAY_IMPORT)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_its_layer_may(package):
    wrong = []
    for path in python_files(package):
        for imported, line in imported_packages(ast.parse(path.read_text(), str(path))).items():
            if imported not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert not wrong, f"{package}/ may import only {sorted(MAY_IMPORT[package])}:\n" + "\n".join(wrong)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    """A leading underscore means "this module's own": another module's private function,
    attribute or class is neither imported nor reached into (a module's own are fine)."""
    wrong = []
    for path in python_files(*sorted(OURS)):
        tree = ast.parse(path.read_text(), str(path))
        own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        own |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
        own |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} imports {alias.name} from {node.module}"
                          for alias in node.names if private(alias.name)]
            elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} uses {ast.unparse(node)}")
    assert not wrong, "private names used from outside their module:\n" + "\n".join(wrong)


def test_only_cartridge_training_imports_torch():
    """Serving never needs torch (an optional extra, lmserve[train]): one module imports it, and
    only ``lmserve cartridge train``/``fleet`` import that module, inside the command."""
    importers = []
    for path in python_files("gateway", "worker", "kvstore", "shared", "launcher"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(name.split(".")[0] == "torch" for name in names):
                importers.append(path.relative_to(REPO).as_posix())
    assert importers == ["worker/cartridge_train.py"]
    for path in python_files("gateway", "worker", "kvstore", "shared", "launcher"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not any(isinstance(n, ast.ImportFrom) and n.module == "worker.cartridge_train" for n in top_level), path
