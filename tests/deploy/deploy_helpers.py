"""What the deployment tests share: the files under test, the role parsers, and nginx
run from ``deploy/nginx.conf`` with its upstream pointed at real loopback gateways."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
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


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


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


class NginxProcess(ChildProcess):
    """Debian's nginx in the foreground, in front of the given upstream addresses."""

    def __init__(self, prefix: Path, upstreams: list[str]):
        self.port = free_port()
        self.log_path = prefix / "nginx.out"
        self.config = write_nginx_config(prefix, upstreams, f"127.0.0.1:{self.port}")
        self.args = [nginx_binary(), "-p", str(prefix), "-c", str(self.config), "-g", "daemon off;"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 20) -> None:
        import socket
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited; log:\n{self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("nginx did not start listening")
