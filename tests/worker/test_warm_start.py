"""A warm start answers gateways while its engine thread warms up.

``lmserve worker`` on a start whose kernels numba already keeps hands the warm-up to the engine
thread (``WorkerServer.serve_forever(before=...)``): gateways get the card at once and build
their view of the model meanwhile; requests wait in the queue until the warm-up is done. Here a
worker in this process, on real ZeroMQ sockets, with a tiny model and a warm-up held until the
test lets it go.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import tiny_models
from conftest import free_port
from test_worker import collect

from gateway.worker_client import WorkerClient
from shared.errors import LmserveError
from shared.protocol import FinishReason, Generate
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.scheduler import SchedulerSettings
from worker.server import WorkerServer, WorkerSettings


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model = tmp_path_factory.mktemp("warm") / "tiny-qwen3.gguf"
    tiny_models.write_tiny_gguf(model, "qwen3", context_length=512)
    return Engine.load(model)


def _server(engine: Engine) -> tuple[WorkerServer, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return WorkerServer(engine, WorkerSettings(endpoint=endpoint, scheduler=SchedulerSettings(ctx=512))), endpoint


def test_the_card_goes_out_during_the_warm_up_and_a_request_waits_for_its_end(engine):
    server, endpoint = _server(engine)
    release, warmed = threading.Event(), threading.Event()

    def warm_up() -> None:
        assert release.wait(60)
        engine.warm_up()
        warmed.set()

    thread = threading.Thread(target=server.serve_forever, kwargs={"before": warm_up}, daemon=True)
    thread.start()

    async def talk() -> None:
        client = WorkerClient(endpoint)
        await client.start()
        try:
            card = await client.wait_ready(30)
            assert card.model_id == engine.model_id and not warmed.is_set()
            request = Generate(client.new_request_id(), [1, 2, 3, 4], SamplingParams(temperature=0.0), 3,
                               stop_ids=[])  # no end of turn: three tokens
            reply = asyncio.ensure_future(collect(client, request))
            await asyncio.sleep(1.0)
            assert not reply.done()  # queued behind the warm-up
            release.set()
            ids, finished = await asyncio.wait_for(reply, 60)
            assert warmed.is_set() and len(ids) == 3 and finished.reason == FinishReason.LENGTH
        finally:
            await client.close()

    try:
        asyncio.run(talk())
    finally:
        release.set()
        server.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_warm_up_that_fails_ends_serving_with_its_error(engine):
    server, _ = _server(engine)

    def broken() -> None:
        raise LmserveError("the warm-up broke")

    with pytest.raises(LmserveError, match="the warm-up broke"):
        server.serve_forever(before=broken)


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
