"""Starting the two servers, lmserve and llama.cpp's ``llama-server``, on free ports, waiting until
they answer ready, and stopping them with their process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.faults import free_port

REPO = Path(__file__).resolve().parent.parent
LMSERVE = "lmserve"
PEER = "llama.cpp"
SERVERS = (LMSERVE, PEER)


@dataclass
class ServerSpec:
    name: str
    command: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def lmserve_spec(model: str, ctx: int, parallel: int, threads: int, kv_slots: int | None = None,
                 kernel_cache: str | None = None) -> ServerSpec:
    """``lmserve serve`` with --batch ``parallel`` (and --kv-slots its default, unless given);
    ``kernel_cache``: numba's cache directory for the run (an empty one: a first start)."""
    port = free_port()
    env = {k: str(threads) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if kernel_cache:
        env["NUMBA_CACHE_DIR"] = kernel_cache
    slots = ["--kv-slots", str(kv_slots)] if kv_slots else []
    return ServerSpec(LMSERVE, [sys.executable, "-m", "launcher.cli", "serve", model, "--ctx", str(ctx),
                                "--batch", str(parallel), *slots, "--threads", str(threads), "--port", str(port)],
                      port, "/health", env)


def peer_spec(binaries: Path, model: str, ctx: int, parallel: int, threads: int) -> ServerSpec:
    port = free_port()
    return ServerSpec(PEER, [str(binaries / "llama-server"), "-m", model, "-c", str(ctx), "--parallel", str(parallel),
                             "--kv-unified", "-t", str(threads), "-tb", str(threads),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/health")


def start_server(spec: ServerSpec, log: Path, timeout: float = 600.0) -> subprocess.Popen:
    """Start a server and wait until it answers ready; ``proc.ready_after`` is how long that
    took (seconds, to a tenth)."""
    import httpx
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(spec.command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **spec.env}, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} while starting; "
                               f"log {log}:\n{_tail(log)}")
        try:
            if httpx.get(spec.base_url + spec.ready_path, timeout=2).status_code == 200:
                proc.ready_after = time.monotonic() - started  # type: ignore[attr-defined]
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"{spec.name} not ready after {timeout:.0f} s; log {log}:\n{_tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
