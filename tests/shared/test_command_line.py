"""One rule for LMSERVE_* variables across every role: the environment sets a flag's default,
the command line wins, a malformed variable is a usage error that names it."""

from __future__ import annotations

import pytest

from gateway.flags import build_parser as gateway_parser
from gateway.main import settings_from
from worker.flags import build_parser as worker_parser


pytestmark = pytest.mark.usefixtures("no_lmserve_environment")


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
