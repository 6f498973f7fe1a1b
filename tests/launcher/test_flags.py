"""Flags of the roles lmserve serve starts: each says its LMSERVE_* variable, serve knows every
one of them and hands them on unchanged; README.md's tables list them all."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from gateway.flags import build_parser as gateway_parser
from launcher.flags import build_parser as serve_parser
from launcher.flags import to_argv
from shared.command_line import EnvParser, env_name
from worker.flags import build_parser as worker_parser

ROLES = {"serve": serve_parser, "worker": worker_parser, "gateway": gateway_parser}
# the pipe between lmserve serve and its worker, and the wire's keys, made for each run
SERVE_SETS_ITSELF = {"--status-fd", "--wire-key", "--wire-allow", "--wire-insecure", "--worker-key"}


pytestmark = pytest.mark.usefixtures("no_lmserve_environment")


def _flags(parser: EnvParser) -> set[str]:
    return {action.option_strings[-1] for action in parser.options}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_flag_says_its_variable_in_the_help(role):
    for action in ROLES[role]().options:
        assert action.help.endswith(f"[env {env_name(action.option_strings[0])}]"), action.option_strings


def test_serve_takes_every_flag_of_the_roles_it_starts():
    serve = _flags(serve_parser())
    for role in ("worker", "gateway"):
        test_only = {a.option_strings[-1] for a in ROLES[role]().options if a.help.startswith("FOR TESTS ONLY")}
        missing = _flags(ROLES[role]()) - serve - SERVE_SETS_ITSELF - test_only
        assert not missing, f"lmserve serve lacks {role} flags {sorted(missing)}"
    assert "--gateways" in serve


def test_serve_hands_its_settings_to_the_roles_unchanged():
    args = serve_parser().parse_args(["--ctx", "1024", "--batch", "2", "--allow-host", "x.example,y.example",
                                      "--log-format", "json", "--drain-timeout", "5", "--worker", "tcp://127.0.0.1:1"])
    worker = worker_parser().parse_args(["/m.gguf", *to_argv(worker_parser(), args)])
    gateway = gateway_parser().parse_args(to_argv(gateway_parser(), args))
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


def test_nanochat_names_the_model_directory(tmp_path, capsys):
    from worker.flags import model_argument

    for role in ("serve", "worker"):
        parser = ROLES[role]()
        args = parser.parse_args(["--nanochat", str(tmp_path)])
        assert model_argument(parser, args) == str(tmp_path) and args.model == str(tmp_path) and args.nanochat is None
        for argv, says in (([str(tmp_path / "other.gguf"), "--nanochat", str(tmp_path)], "not both"),
                           (["--nanochat", str(tmp_path / "missing")], "not a directory")):
            with pytest.raises(SystemExit):
                model_argument(parser, parser.parse_args(argv))
            assert says in capsys.readouterr().err
