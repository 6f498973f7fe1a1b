"""What the deployment tests share: the files under test, the role parsers, a deployment's
shell commands run on this machine, and nginx run from ``deploy/nginx.conf`` with its upstream
pointed at real loopback gateways."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, ChildProcess, free_port

from gateway.flags import build_parser as gateway_parser
from launcher.flags import build_parser as serve_parser
from shared.command_line import ENV_PREFIX, env_name
from worker.flags import build_parser as worker_parser

DEPLOY = REPO / "deploy"
NGINX_CONF = DEPLOY / "nginx.conf"
KUBERNETES = DEPLOY / "kubernetes"
ROLE_PARSERS = {"worker": worker_parser, "gateway": gateway_parser, "serve": serve_parser}
KEYS = "/keys"  # where every container of every deployment finds its keys

# $$, ${NAME}, ${NAME:-default}, $NAME, or (the empty last branch) a $ compose cannot read
_COMPOSE_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|([A-Za-z_]\w*)|)")
# $$ or $(NAME); any other $ is left as it is
_KUBERNETES_VARIABLE = re.compile(r"\$(?:(\$)|\(([A-Za-z_][\w.-]*)\))")


def compose_interpolate(value: str) -> str:
    """A string of the compose file as compose hands it on, with the host's variables unset:
    ``$$`` is a literal ``$``, ``${NAME:-default}`` its default, and a lone ``$`` an error."""
    def replace(match: re.Match) -> str:
        escaped, braced, default, named = match.groups()
        if escaped:
            return "$"
        assert braced or named, f"docker compose rejects {value!r}: write $$ for a literal $"
        return default or ""
    return _COMPOSE_VARIABLE.sub(replace, value)


def kubernetes_expand(value: str, env: dict[str, str]) -> str:
    """A command or args item as the kubelet runs it: ``$(NAME)`` of the container's variables
    replaced, ``$$`` a literal ``$``, any other reference left as it is."""
    def replace(match: re.Match) -> str:
        escaped, name = match.groups()
        if escaped:
            return "$"
        return env.get(name, match.group(0))
    return _KUBERNETES_VARIABLE.sub(replace, value)


def _interpolated(node):
    if isinstance(node, str):
        return compose_interpolate(node)
    if isinstance(node, list):
        return [_interpolated(item) for item in node]
    if isinstance(node, dict):
        return {key: _interpolated(value) for key, value in node.items()}
    return node


def compose() -> dict:
    """docker-compose.yml as compose reads it: merge keys resolved, every string interpolated."""
    return _interpolated(yaml.safe_load((REPO / "docker-compose.yml").read_text()))


def kubernetes_documents() -> list[dict]:
    documents = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


def role_env_names(role: str) -> set[str]:
    parser = ROLE_PARSERS[role]()
    names = {env_name(action.option_strings[-1]) for action in parser.options}
    if any(action.dest == "model" for action in parser.arguments):
        names.add(env_name("--model"))
    return names


def parse_command(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[str, argparse.Namespace]:
    """Parse ``lmserve ROLE ...`` with that role's real parser, under the given LMSERVE_* variables."""
    assert command[0] == "lmserve", command
    role, rest = command[1], command[2:]
    assert role in ROLE_PARSERS, f"unknown role {role!r}"
    unknown = {name for name in env if name.startswith(ENV_PREFIX)} - role_env_names(role)
    assert not unknown, f"{role}: {sorted(unknown)} name no flag of lmserve {role}"
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return role, ROLE_PARSERS[role]().parse_args(rest)
    except SystemExit:
        raise AssertionError(f"lmserve {role} rejects {rest} with {env}")


# --- a container's command, run here -------------------------------------------------------

def here(argv: list[str], keys: Path) -> list[str]:
    """A container's command line run on this machine: its keys directory at ``keys``, and
    ``lmserve`` (the program, alone or after a shell shim) this checkout's."""
    program = [sys.executable, "-m", "launcher.cli"]
    return [part for arg in argv for part in (program if arg == "lmserve" else [arg.replace(KEYS, str(keys))])]


def redis_wrappers(folder: Path, port: int) -> Path:
    """``redis-server`` and ``redis-cli`` that run Debian's on a loopback ``port`` (redis-server
    takes the last of a repeated option): put first on PATH, a deployment's Redis command and
    probes run here unchanged. Returns the folder to put on PATH."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    extra = {"redis-server": f'"$@" --port {port} --bind 127.0.0.1 --dir {folder}',
             "redis-cli": f'-p {port} "$@"'}
    for name, arguments in extra.items():
        wrapper = folder / name
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which(name)} {arguments}\n")
        wrapper.chmod(0o755)
    return folder


class ListeningProcess(ChildProcess):
    """A child process that is ready once it accepts connections on its loopback ``port``."""

    port: int

    def wait_ready(self, timeout: float = 20) -> None:
        import socket
        what = type(self).__name__
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited; log:\n{self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{what} did not start listening")


class DeployedRedis(ListeningProcess):
    """A deployment's own Redis command line, run here with redis_wrappers first on PATH."""

    def __init__(self, argv: list[str], log_path: Path, port: int):
        self.args, self.log_path, self.port = argv, log_path, port


# --- nginx ---------------------------------------------------------------------------------

def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found is None:
        pytest.fail("nginx is not installed (Debian package nginx; .ci/run installs it)")
    return found


def render_site(upstreams: list[str], listen: str) -> str:
    """deploy/nginx.conf with its upstream servers and listen address replaced, all else as shipped."""
    text = NGINX_CONF.read_text()
    server_line = re.search(r"^(\s*)server\s+(\S+)(.*);$", text, re.MULTILINE)
    assert server_line, "deploy/nginx.conf has no upstream server line"
    indent, _, options = server_line.groups()
    servers = "\n".join(f"{indent}server {address}{options};" for address in upstreams)
    text = text[:server_line.start()] + servers + text[server_line.end():]
    text, listens = re.subn(r"^(\s*)listen\s+\S+;", rf"\1listen {listen};", text, flags=re.MULTILINE)
    assert listens == 1
    return text


def write_nginx_config(prefix: Path, upstreams: list[str], listen: str) -> Path:
    """A main config around the rendered site, with every path inside ``prefix``."""
    prefix.mkdir(parents=True, exist_ok=True)
    site = prefix / "lmserve.conf"
    site.write_text(render_site(upstreams, listen))
    temp = "\n".join(f"    {kind}_temp_path {prefix / kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # As root, workers would drop to nobody, who cannot reach a private temp directory.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = prefix / "nginx.conf"
    main.write_text(
        f"{user}worker_processes 1;\npid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} warn;\n"
        f"events {{ worker_connections 512; }}\n"
        f"http {{\n    access_log {prefix / 'access.log'};\n{temp}\n    include {site};\n}}\n")
    return main


def check_nginx_config(main: Path) -> subprocess.CompletedProcess:
    return subprocess.run([nginx_binary(), "-t", "-p", str(main.parent), "-c", str(main)], check=False,
                          capture_output=True, text=True, timeout=30)


class NginxProcess(ListeningProcess):
    """Debian's nginx in the foreground, in front of the given upstream addresses."""

    def __init__(self, prefix: Path, upstreams: list[str]):
        self.port = free_port()
        self.log_path = prefix / "nginx.out"
        self.config = write_nginx_config(prefix, upstreams, f"127.0.0.1:{self.port}")
        self.args = [nginx_binary(), "-p", str(prefix), "-c", str(self.config), "-g", "daemon off;"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
