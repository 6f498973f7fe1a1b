"""The gateway's side of the wire against a worker that sends malformed messages: a real
``WorkerClient`` connected over ZeroMQ to a ROUTER socket this test drives. Every malformed reply
is dropped with a log line; the request it names fails at once (and is aborted at the worker);
the client's other requests complete, and no exception escapes its tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgpack
import pytest
import zmq
import zmq.asyncio
from conftest import free_port, run

from gateway.worker_client import WorkerClient
from shared.errors import WorkerUnavailableError
from shared.protocol import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    Capabilities,
    Finished,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    ModelCard,
    Tags,
    Tokens,
    decode,
)
from shared.tokenizer_spec import TokenizerSpec

SPEC = TokenizerSpec.of_tokens(["a", "b", "ab"], model="gpt2", token_types=bytes([1, 1, 1]), bos_id=None,
                               eos_id=None, add_bos=False, add_eos=False, pre="gpt2",
                               merges=["a b"])
CARD = ModelCard(PROTOCOL_VERSION, "m", "llama", 512, 3, SPEC, None, "fp", Capabilities(512, Tags("<t>", "</t>")),
                 instance="one")


def packed(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


# replies that name no request of the client's: each is dropped, and nothing else changes
UNNAMED = [
    *[[kind, packed([1, 2])] for kind in sorted(MESSAGE_CLASSES)],  # a body that is no map, of every type
    [b"Z", packed({})],  # no such type
    [b"T", b"\xc1"],  # no msgpack
    [b"T"],  # no body
    [b"C", packed({"version": PROTOCOL_VERSION})],  # a card without its fields
    [b"P", packed({"sent_at": "now"})],
    [b"H", packed({"version": "3"})],
    [b"G", packed({"request_id": 5}), b""],
    [b"X", packed({"request_id": None})],
    [b"T", packed({"request_id": 5, "ids": [1]})],
    [b"A", packed({"request_id": "nobody's", "queue_position": "x"})],
    # well-formed, but not what a worker sends: ignored
    Hello(PROTOCOL_VERSION, "not a worker").frames(),
    Abort("ok-1").frames(),
]


class FakeWorker:
    """A ROUTER the client connects to, answering as the test says."""

    def __init__(self):
        self.context = zmq.asyncio.Context.instance()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.router.bind(self.endpoint)
        self.gateway: bytes | None = None
        self.received: list = []

    async def next_message(self, kinds: tuple[type, ...], timeout: float = 10.0):
        """The next message of these types from the client (heartbeats and others skipped)."""
        async with asyncio.timeout(timeout):
            while True:
                identity, *frames = await self.router.recv_multipart()
                self.gateway = identity
                message = decode(frames)
                self.received.append(message)
                if isinstance(message, kinds):
                    return message

    async def send(self, frames: list[bytes]) -> None:
        await self.router.send_multipart([self.gateway, *frames])

    def close(self) -> None:
        self.router.close(0)


async def _collect(client: WorkerClient, request: Generate) -> list:
    return [message async for message in client.generate(request)]


@contextlib.asynccontextmanager
async def greeted():
    """A started client and the fake worker it has said HELLO to; both closed at the end."""
    worker = FakeWorker()
    client = WorkerClient(worker.endpoint, heartbeat_interval=0.2, heartbeat_timeout=30)
    await client.start()
    try:
        await worker.next_message((Hello,))
        yield worker, client
    finally:
        await client.close()
        worker.close()


async def refusal(client: WorkerClient) -> str:
    """The reason the client gives for not taking the worker's card, once it has one."""
    async with asyncio.timeout(10):
        while client.version_error is None:
            await asyncio.sleep(0.02)
    assert not client.ready
    return client.version_error


def test_malformed_replies_are_dropped_and_the_requests_they_name_fail_alone(caplog):
    async def scenario():
        escaped = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: escaped.append(context))
        worker = FakeWorker()
        client = WorkerClient(worker.endpoint, heartbeat_interval=0.2, heartbeat_timeout=30)
        await client.start()
        try:
            await worker.next_message((Hello,))
            # a card that does not parse: dropped, and /health's error says why the client is not ready
            await worker.send([b"C", packed({**CARD.body(), "tokenizer": []})])
            assert "does not parse" in await refusal(client)
            await worker.next_message((Hello,))  # the client asks again
            await worker.send(CARD.frames())
            await client.wait_ready(10)

            requests = {name: Generate(name, [1, 2], max_tokens=4)
                        for name in ("accepted", "tokens", "finished", "busy", "rejected", "ok-1", "ok-2")}
            tasks = {name: asyncio.create_task(_collect(client, request)) for name, request in requests.items()}
            for _ in requests:
                await worker.next_message((Generate,))
            for name in ("tokens", "finished", "ok-1", "ok-2"):
                await worker.send(Accepted(name).frames())
            await worker.send([b"A", packed({"request_id": "accepted", "queue_position": "first"})])
            await worker.send([b"B", packed({"request_id": "busy", "retry_after": "soon"})])
            await worker.send([b"R", packed({"request_id": "rejected", "status": "bad"})])
            await worker.send(Tokens("ok-1", [1]).frames())
            await worker.send([b"T", packed({"request_id": "tokens", "ids": "many"})])
            await worker.send(Tokens("ok-2", [2]).frames())
            await worker.send([b"F", packed({"request_id": "finished", "reason": "tired"})])
            for frames in UNNAMED:
                await worker.send(frames)
            await worker.send(Heartbeat(0.0, "one", 0, 2).frames())
            await worker.send(Tokens("ok-1", [2]).frames())
            for name in ("ok-1", "ok-2"):
                await worker.send(Finished(name, FinishReason.LENGTH, 2, 0, 2).frames())

            outcomes = {}
            for name, task in tasks.items():
                try:
                    outcomes[name] = await asyncio.wait_for(task, 10)
                except WorkerUnavailableError as exc:
                    outcomes[name] = exc.message
            aborted = set()
            while len(aborted) < 5:
                aborted.add((await worker.next_message((Abort,))).request_id)
            running = {task.get_name() for task in asyncio.all_tasks()}
            return outcomes, aborted, client.worker_load, running, escaped
        finally:
            await client.close()
            worker.close()

    with caplog.at_level(logging.WARNING, logger="lmserve.gateway"):
        outcomes, aborted, load, running, escaped = run(scenario())
    for name, field in (("accepted", "queue_position"), ("busy", "retry_after"), ("rejected", "status"),
                        ("tokens", "ids"), ("finished", "reason")):
        assert outcomes[name].startswith("the worker sent a malformed reply") and field in outcomes[name], name
    assert aborted == {"accepted", "busy", "rejected", "tokens", "finished"}
    ok_1, ok_2 = outcomes["ok-1"], outcomes["ok-2"]
    assert [type(m) for m in ok_1] == [Accepted, Tokens, Tokens, Finished] and ok_1[1].ids + ok_1[2].ids == [1, 2]
    assert [type(m) for m in ok_2] == [Accepted, Tokens, Finished]
    assert load == (0, 2)  # the heartbeat after the garbage was taken in
    assert {"worker-reader", "worker-heartbeat", "worker-connection"} <= running and not escaped
    dropped = [r for r in caplog.records if "dropping a malformed message" in r.getMessage()]
    ignored = [r for r in caplog.records if "ignoring a" in r.getMessage()]
    assert len(dropped) == 1 + 5 + len(UNNAMED) - 2 and len(ignored) == 2


@pytest.mark.parametrize("kind", sorted(MESSAGE_CLASSES))
def test_a_non_map_body_of_any_type_leaves_the_client_serving(kind, caplog):
    """The same for one type at a time, and with the card not yet taken: the client says HELLO
    again and takes the next, good card."""
    async def scenario():
        async with greeted() as (worker, client):
            await worker.send([kind, packed(["not", "a", "map"])])
            await worker.send([kind, packed({"request_id": ["x"], "version": "x", "sent_at": "x"})])
            await worker.next_message((Hello,))
            await worker.send(CARD.frames())
            await client.wait_ready(10)
            task = asyncio.create_task(_collect(client, Generate("r", [1], max_tokens=1)))
            await worker.next_message((Generate,))
            await worker.send(Accepted("r").frames())
            await worker.send(Finished("r", FinishReason.LENGTH, 1, 0, 0).frames())
            return await asyncio.wait_for(task, 10)

    with caplog.at_level(logging.WARNING, logger="lmserve.gateway"):
        replies = run(scenario())
    assert [type(m) for m in replies] == [Accepted, Finished]
    assert sum("dropping a malformed message" in r.getMessage() for r in caplog.records) == 2


def test_a_card_naming_a_convention_this_gateway_does_not_know_is_refused_with_its_name():
    """A worker of a newer release (or with a plug-in the gateway lacks) names a convention the
    gateway cannot read replies of: the client is not ready, and /health's error names it."""
    async def scenario():
        async with greeted() as (worker, client):
            body = CARD.body()
            body["capabilities"] = {**body["capabilities"], "convention": "smoke_signals"}
            await worker.send([b"C", packed(body)])
            assert "smoke_signals" in await refusal(client)

    run(scenario())
