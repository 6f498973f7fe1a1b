"""Starting the two servers, lmserve and llama.cpp's ``llama-server``, on free ports, waiting until
they answer ready, and stopping them with their process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
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
                 kernel_cache: str | None = None, extra: Sequence[str] = ()) -> ServerSpec:
    """``lmserve serve`` with --batch ``parallel`` (and --kv-slots its default, unless given);
    ``kernel_cache``: numba's cache directory for the run (an empty one: a first start);
    ``extra``: more flags (a worker's --spec)."""
    port = free_port()
    env = {k: str(threads) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if kernel_cache:
        env["NUMBA_CACHE_DIR"] = kernel_cache
    slots = ["--kv-slots", str(kv_slots)] if kv_slots else []
    return ServerSpec(LMSERVE, [sys.executable, "-m", "launcher.cli", "serve", model, "--ctx", str(ctx),
                                "--batch", str(parallel), *slots, "--threads", str(threads), "--port", str(port),
                                *extra],
                      port, "/health", env)


def peer_spec(binaries: Path, model: str, ctx: int, parallel: int, threads: int,
              extra: Sequence[str] = ()) -> ServerSpec:
    port = free_port()
    return ServerSpec(PEER, [str(binaries / "llama-server"), "-m", model, "-c", str(ctx), "--parallel", str(parallel),
                             "--kv-unified", "-t", str(threads), "-tb", str(threads),
                             "--host", "127.0.0.1", "--port", str(port), *extra],
                      port, "/health")


# llama-server's n-gram speculation for the edit workload: the fastest edit reply in a trial on
# the default model, 2 threads (edit tok/s, one or two readings each; 63 without speculation):
# ngram-cache 49, ngram-simple 72, ngram-map-k4v 94, ngram-map-k 90-96, ngram-mod at its defaults
# (drafts of 48 to 64 tokens) 104-114, ngram-mod with drafts of 32 to 128 tokens 139-145 (64 to
# 256: 140; with a 16-token lookup: 143); shorter lookups of ngram-simple and ngram-map-k were slower.
PEER_NGRAM = ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "32", "--spec-ngram-mod-n-max", "128")


@dataclass(frozen=True)
class Variant:
    """One server configuration of the speculation comparison."""
    name: str  # as the table heads its column
    server: str  # LMSERVE or PEER
    flags: tuple[str, ...]  # appended to the server's command line


SPEC_OFF, SPEC_ON, PEER_OFF, PEER_ON = "lmserve spec off", "lmserve spec ngram", "llama.cpp no spec", "llama.cpp ngram"


def speculation_variants(spec_max: int, peer_ngram: Sequence[str] = PEER_NGRAM,
                         servers: Sequence[str] = SERVERS) -> list[Variant]:
    """lmserve without and with n-gram speculation, llama-server without and with its own, of
    the servers wanted."""
    every = [Variant(SPEC_OFF, LMSERVE, ("--spec", "off")),
             Variant(SPEC_ON, LMSERVE, ("--spec", "ngram", "--spec-max", str(spec_max))),
             Variant(PEER_OFF, PEER, ()),
             Variant(PEER_ON, PEER, tuple(peer_ngram))]
    return [v for v in every if v.server in servers]


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


def settle(proc: subprocess.Popen, idle_cores: float = 0.1, timeout: float = 180.0) -> float:
    """Wait until the server's process tree uses at most ``idle_cores`` over a second (a first
    start's compiling in the background is over); returns the seconds waited."""
    import psutil
    started = time.monotonic()

    def cpu() -> float:
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        total = 0.0
        for p in tree:
            try:
                times = p.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
            except psutil.Error:
                pass
        return total
    while time.monotonic() - started < timeout and proc.poll() is None:
        before = cpu()
        time.sleep(1.0)
        if cpu() - before <= idle_cores:
            break
    return time.monotonic() - started


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
