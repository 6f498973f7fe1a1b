"""Flags: one rule for LMSERVE_* variables across serve, worker and gateway; serve knows every
flag of the roles it starts; README.md's tables list them all."""

from __future__ import annotations

import argparse
import re

import pytest
from conftest import REPO

from gateway.flags import build_parser as gateway_parser
from gateway.main import settings_from
from shared import settings
from shared.serve import build_parser as serve_parser
from worker.flags import build_parser as worker_parser

ROLES = {"serve": serve_parser, "worker": worker_parser, "gateway": gateway_parser}
SERVE_SETS_ITSELF = {"--status-fd"}  # the pipe between lmserve serve and its worker


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os
    for name in list(os.environ):
        if name.startswith(settings.ENV_PREFIX):
            monkeypatch.delenv(name)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {action.option_strings[-1] for action in settings.option_actions(parser)}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_flag_says_its_variable_in_the_help(role):
    for action in settings.option_actions(ROLES[role]()):
        assert action.help.endswith(f"[env {settings.env_name(action.option_strings[0])}]"), action.option_strings


def test_the_environment_sets_defaults_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("LMSERVE_PORT", "9999")
    monkeypatch.setenv("LMSERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("LMSERVE_ALLOW_HOST", "a.example, b.example")
    args = gateway_parser().parse_args([])
    assert (args.port, args.log_format, args.allow_host) == (9999, "json", ["a.example", "b.example"])
    args = gateway_parser().parse_args(["--port", "1234", "--allow-host", "c.example,d.example",
                                        "--allow-host", "e.example"])
    assert args.port == 1234
    assert args.allow_host == ["c.example", "d.example", "e.example"]  # replaces the environment's list
    assert settings_from(args).edge.allow_hosts == ["c.example", "d.example", "e.example"]
    monkeypatch.setenv("LMSERVE_CTX", "2048")
    monkeypatch.setenv("LMSERVE_MODEL", "/m.gguf")
    worker = worker_parser().parse_args([])
    assert (worker.ctx, worker.model) == (2048, "/m.gguf")


@pytest.mark.parametrize("name, value", [("LMSERVE_PORT", "eighty"), ("LMSERVE_LOG_FORMAT", "xml")])
def test_a_malformed_variable_is_a_usage_error_naming_it(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        gateway_parser().parse_args([])
    assert stopped.value.code == 2
    assert f"{name}={value!r} is not a valid value" in capsys.readouterr().err


def test_serve_takes_every_flag_of_the_roles_it_starts():
    serve = _flags(serve_parser())
    for role in ("worker", "gateway"):
        test_only = {a.option_strings[-1] for a in settings.option_actions(ROLES[role]())
                     if a.help.startswith("FOR TESTS ONLY")}
        missing = _flags(ROLES[role]()) - serve - SERVE_SETS_ITSELF - test_only
        assert not missing, f"lmserve serve lacks {role} flags {sorted(missing)}"
    assert "--gateways" in serve


def test_serve_hands_its_settings_to_the_roles_unchanged():
    args = serve_parser().parse_args(["--ctx", "1024", "--batch", "2", "--allow-host", "x.example,y.example",
                                      "--log-format", "json", "--drain-timeout", "5", "--worker", "tcp://127.0.0.1:1"])
    worker = worker_parser().parse_args(["/m.gguf", *settings.to_argv(worker_parser(), args)])
    gateway = gateway_parser().parse_args(settings.to_argv(gateway_parser(), args))
    for parsed in (worker, gateway):
        for name, value in vars(parsed).items():
            if hasattr(args, name) and name != "model":
                assert getattr(args, name) == value, name
    assert gateway.allow_host == ["x.example", "y.example"] and worker.batch == 2


def test_readme_tables_list_every_flag():
    readme = (REPO / "README.md").read_text()
    for role, build in ROLES.items():
        section = re.search(rf"^### `lmserve {role}` flags\n(.*?)(?=^#)", readme, re.MULTILINE | re.DOTALL)
        assert section, f"README.md has no table of lmserve {role} flags"
        listed = set(re.findall(r"^\| `(--[a-z0-9-]+)", section.group(1), re.MULTILINE))
        assert listed == _flags(build()), f"lmserve {role}: README lists {sorted(listed ^ _flags(build()))} wrongly"
