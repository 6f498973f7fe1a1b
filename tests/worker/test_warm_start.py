"""A start warms up before it answers; a worker gives back what its passes freed.

``lmserve worker`` runs each kernel once before any gateway gets its card, on a warm start too:
loading numba's compiled kernels brings LLVM's code into memory until the warm-up pages it out,
and that peak is not to overlap the gateways building their view of the model or the first
requests. Here real worker processes on a tiny model, and a worker in this process on real
ZeroMQ sockets.
"""

from __future__ import annotations

import pytest
import tiny_models
from conftest import free_port

from shared.protocol import Generate
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.scheduler import SchedulerSettings
from worker.server import WorkerServer, WorkerSettings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "tiny-qwen3.gguf"
    tiny_models.write_tiny_gguf(path, "qwen3", context_length=512)
    return path


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    return Engine.load(model)


def _server(engine: Engine) -> tuple[WorkerServer, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return WorkerServer(engine, WorkerSettings(endpoint=endpoint, scheduler=SchedulerSettings(ctx=512))), endpoint


def test_every_start_runs_its_kernels_before_it_answers(start_worker, model):
    for _ in range(2):  # the second start reads the kernels the first left in numba's cache
        worker = start_worker(model, "--ctx", "512")
        log = worker.log_path.read_text(encoding="utf-8")
        worker.stop()
        assert "kernels ready in" in log and "worker ready on" in log, log[-2000:]
        assert log.index("kernels ready in") < log.index("worker ready on"), log[-2000:]


def test_the_worker_gives_back_free_memory_each_time_it_runs_out_of_work(engine, monkeypatch):
    """glibc keeps what a forward pass freed inside the heap for the next one: the worker
    returns it once each time its scheduler has nothing left to run, not on every idle loop."""
    import worker.server

    trims: list[int] = []
    monkeypatch.setattr(worker.server, "give_back_freed_memory", lambda: trims.append(1) or True)
    server, _ = _server(engine)
    scheduler = server.scheduler
    scheduler.between_steps()
    assert trims == []  # nothing has run since the start
    for round_ in (1, 2):
        scheduler.submit(b"gw", Generate(f"r{round_}", [1, 2, 3], SamplingParams(temperature=0.0), 2, stop_ids=[]))
        scheduler.admit()
        while scheduler.running:
            scheduler.between_steps()
            assert len(trims) == round_ - 1  # not while a stream runs
            scheduler.step()
        for _ in range(3):
            scheduler.between_steps()
        assert len(trims) == round_
