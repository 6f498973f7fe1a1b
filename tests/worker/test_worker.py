"""The worker process over real ZeroMQ, on the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import zmq
from conftest import REPO, run

from gateway.worker_client import WorkerClient
from shared.chat_template import ChatTemplate
from shared.errors import BusyError, InvalidRequestError, WorkerUnavailableError
from shared.protocol import PROTOCOL_VERSION, Accepted, Finished, Generate, Heartbeat, Hello, MsgType, Tokens
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

QUESTIONS = [
    "Name the capital city of France.",
    "Name three primary colors.",
    "What is two plus two?",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def batch_worker(start_worker, default_model):
    return start_worker(default_model, "--batch", "4", "--kv-slots", "6", "--queue", "8",
                        "--heartbeat-timeout", "2")


@pytest.fixture(scope="module")
def sequential_worker(start_worker, default_model):
    return start_worker(default_model, "--queue", "1", "--ctx", "512")


async def _client(endpoint: str) -> WorkerClient:
    client = WorkerClient(endpoint)
    await client.start()
    await client.wait_ready(60)
    return client


def _prompt(client: WorkerClient, question: str, history: list[dict] | None = None) -> list[int]:
    card = client.card
    tokenizer = Tokenizer.from_spec(card.tokenizer)
    messages = (history or []) + [{"role": "user", "content": question}]
    text = ChatTemplate(card.chat_template).render(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special=False)


async def collect(client: WorkerClient, request: Generate) -> tuple[list[int], Finished]:
    ids: list[int] = []
    async for message in client.generate(request):
        if isinstance(message, Tokens):
            ids.extend(message.ids)
        elif isinstance(message, Finished):
            return ids, message
    raise AssertionError("stream ended without FINISHED")


def _greedy(client: WorkerClient, prompt: list[int], max_tokens: int = 24, **extra) -> Generate:
    return Generate(client.new_request_id(), prompt, SamplingParams(temperature=0.0), max_tokens, **extra)


def test_model_card_describes_the_model(batch_worker):
    async def go():
        client = await _client(batch_worker.endpoint)
        await client.close()
        return client.card
    card = run(go())
    assert card.version == PROTOCOL_VERSION
    assert card.architecture == "llama"
    assert card.n_vocab == 49152
    assert card.context_budget == 8192  # no --ctx: the model's trained context (llama.context_length)
    capabilities = card.capabilities
    assert (capabilities.batch, capabilities.kv_slots, capabilities.context_length) == (4, 6, 8192)
    assert not capabilities.reasoning and capabilities.tool_call_tags is None  # SmolLM2 has neither
    assert "<|im_start|>" in card.chat_template
    assert Tokenizer.from_spec(card.tokenizer).vocab_size == 49152


def test_version_mismatch_fails_at_hello_naming_both_versions(batch_worker):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(batch_worker.endpoint)
    try:
        sock.send_multipart([b"H", msgpack.packb({"version": 999, "gateway": "old"})])
        assert sock.poll(10_000), "no answer to HELLO"
        kind, body = sock.recv_multipart()
        reply = msgpack.unpackb(body)
        assert kind == b"R"
        assert "999" in reply["message"] and str(PROTOCOL_VERSION) in reply["message"]
    finally:
        sock.close(0)


def test_a_flood_of_hellos_gets_one_card_and_stalls_no_heartbeat(batch_worker):
    """A client that said HELLO every second while the worker was loading has them all delivered
    when it binds. Packing a card (megabytes of tokenizer) for each held the worker's IO thread
    for seconds, and gateways beside it saw no heartbeat and gave their streams up."""
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(batch_worker.endpoint)

    async def watch() -> tuple[int, float]:
        client = await _client(batch_worker.endpoint)
        try:
            for _ in range(300):
                flood.send_multipart(Hello(PROTOCOL_VERSION, "flood").frames())
            beats, longest, last = 0, 0.0, time.monotonic()
            deadline = last + 3.0
            while time.monotonic() < deadline:  # the other client's view: when was it last heard from
                heard = client.last_heard
                if heard > last:
                    beats, longest, last = beats + 1, max(longest, heard - last), heard
                await asyncio.sleep(0.05)
            return beats, max(longest, time.monotonic() - last)
        finally:
            await client.close()

    try:
        beats, longest_gap = asyncio.run(watch())
        cards = 0
        while flood.poll(500):
            kind, *_ = flood.recv_multipart()
            cards += kind == MsgType.MODEL_CARD.value
    finally:
        flood.close(0)
    assert cards == 1, f"{cards} cards for 300 HELLOs from one client"
    assert beats >= 2 and longest_gap < 1.5, (beats, longest_gap)


def test_greedy_answer_is_paris(batch_worker):
    async def go():
        client = await _client(batch_worker.endpoint)
        try:
            ids, finished = await collect(client, _greedy(client, _prompt(client, QUESTIONS[0]), 32))
        finally:
            await client.close()
        return Tokenizer.from_spec(client.card.tokenizer).decode(ids, skip_special=True), finished
    text, finished = run(go())
    assert "Paris" in text
    assert finished.reason == "stop"
    assert finished.completion_tokens >= 5


def test_batched_streams_match_their_solo_texts(batch_worker, capsys):
    async def go():
        client = await _client(batch_worker.endpoint)
        try:
            prompts = [_prompt(client, q) for q in QUESTIONS]
            solo = [(await collect(client, _greedy(client, p, 40)))[0] for p in prompts]
            together = await asyncio.gather(*(collect(client, _greedy(client, p, 40)) for p in prompts))
        finally:
            await client.close()
        return solo, [ids for ids, _ in together]
    solo, together = run(go())
    parted = []
    for question, a, b in zip(QUESTIONS, solo, together):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            parted.append((question, at))
    with capsys.disabled():
        print(f"\nbatch of 4 vs solo: {4 - len(parted)}/4 identical; parted at {parted or 'nowhere'}")
    # Every row's arithmetic is independent of the rows beside it (matmul tiles, attention
    # chunks), and the batch reuses the prefixes the solo runs cached: the same bits either way.
    assert not parted


def test_abort_mid_decode_leaves_the_others_intact(batch_worker):
    async def go():
        client = await _client(batch_worker.endpoint)
        try:
            prompts = [_prompt(client, q) for q in QUESTIONS[:3]]
            solo = [(await collect(client, _greedy(client, p, 30)))[0] for p in prompts]
            victim = Generate(client.new_request_id(), prompts[0], SamplingParams(temperature=0.7, seed=1), 400)

            async def abandon() -> int:
                seen = 0
                async for message in client.generate(victim):
                    seen += len(getattr(message, "ids", []))
                    if seen >= 3:
                        break  # leaving the loop sends ABORT
                return seen

            results = await asyncio.gather(abandon(), *(collect(client, _greedy(client, p, 30)) for p in prompts[1:]))
            for _ in range(50):  # the load arrives with the worker's next heartbeat
                await asyncio.sleep(0.2)
                if client.worker_load == (0, 0):
                    break
            load = client.worker_load
        finally:
            await client.close()
        return solo, results, load
    solo, results, load = run(go())
    assert results[0] >= 3
    for expected, (ids, finished) in zip(solo[1:], results[1:]):
        assert finished.reason in ("stop", "length")
        assert ids == expected
    assert load == (0, 0)


def test_extended_conversation_reports_the_first_prompt_as_cached(batch_worker):
    async def go():
        client = await _client(batch_worker.endpoint)
        try:
            tokenizer = Tokenizer.from_spec(client.card.tokenizer)
            question = "Tell me one fact about the Moon."
            first_prompt = _prompt(client, question)
            ids, first = await collect(client, _greedy(client, first_prompt, 20, cache_hint="conv-1"))
            history = [{"role": "user", "content": question},
                       {"role": "assistant", "content": tokenizer.decode(ids, skip_special=True)}]
            second_prompt = _prompt(client, "And one about Mars?", history)
            _, second = await collect(client, _greedy(client, second_prompt, 8, cache_hint="conv-1"))
        finally:
            await client.close()
        return first_prompt, first, second
    first_prompt, first, second = run(go())
    assert first.cached_tokens < len(first_prompt)
    assert second.cached_tokens >= len(first_prompt)
    assert second.prompt_tokens > second.cached_tokens


def test_queue_overflow_gives_busy(sequential_worker):
    async def go():
        client = await _client(sequential_worker.endpoint)
        try:
            prompt = _prompt(client, QUESTIONS[3])
            # no stop tokens: it decodes until its --ctx 512 is full (seconds), unless aborted
            running = client.generate(Generate(client.new_request_id(), prompt,
                                               SamplingParams(temperature=0.8, seed=3), 2000, stop_ids=[]))
            assert isinstance(await running.__anext__(), Accepted)
            assert isinstance(await running.__anext__(), Tokens)  # the first request is decoding
            queued = client.generate(_greedy(client, prompt, 4))
            accepted = await queued.__anext__()  # the worker took the second into its queue, first in line
            queued_task = asyncio.create_task(_drain(queued))
            # the worker's own count: one decoding, one waiting in the queue of one
            deadline = time.monotonic() + 10
            while client.worker_load != (1, 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            load = client.worker_load
            assert load == (1, 1), f"the queue never filled: (waiting, running) {load}"
            with pytest.raises(BusyError) as busy:
                await collect(client, _greedy(client, prompt, 4))
            await running.aclose()  # abort the long one; the queued one then runs
            queued_finished = await queued_task
        finally:
            await client.close()
        return accepted, busy.value, queued_finished
    accepted, busy, queued_finished = run(go())
    assert isinstance(accepted, Accepted) and accepted.queue_position == 0
    assert busy.status == 429
    assert "queue is full (1 waiting, --queue 1)" in busy.message
    assert queued_finished.reason == "length"


async def _drain(stream) -> Finished:
    async for message in stream:
        if isinstance(message, Finished):
            return message
    raise AssertionError("no FINISHED")


@dataclass
class UncheckedGenerate(Generate):
    """A GENERATE whose sampling map goes out as given, as a client other than our gateway may send it."""
    raw_sampling: dict = field(default_factory=dict)

    def body(self) -> dict:
        return {**super().body(), "sampling": self.raw_sampling}


def test_prompt_beyond_the_context_is_rejected_with_the_numbers(sequential_worker):
    async def go():
        client = await _client(sequential_worker.endpoint)
        try:
            with pytest.raises(InvalidRequestError) as too_long:
                await collect(client, _greedy(client, [42] * 600))
            with pytest.raises(InvalidRequestError) as bad_id:
                await collect(client, _greedy(client, [1, 10**7]))
            with pytest.raises(InvalidRequestError) as bad_param:
                await collect(client, UncheckedGenerate(client.new_request_id(), [1, 2], max_tokens=4,
                                                         raw_sampling={"temperature": -1}))
            ids, ok = await collect(client, _greedy(client, _prompt(client, "Hi"), 4))
        finally:
            await client.close()
        return too_long.value, bad_id.value, bad_param.value, ok
    too_long, bad_id, bad_param, ok = run(go())
    assert too_long.status == 400 and "600" in too_long.message and "512" in too_long.message
    assert "49151" in bad_id.message
    assert "temperature" in bad_param.message
    assert ok.reason == "length"  # the worker is fine afterwards


def test_context_budget_ends_generation(sequential_worker):
    async def go():
        client = await _client(sequential_worker.endpoint)
        try:
            return await collect(client, Generate(client.new_request_id(), [42] * 500,
                                                   SamplingParams(temperature=1.0, seed=0), 100, stop_ids=[]))
        finally:
            await client.close()
    ids, finished = run(go())
    assert finished.reason == "context"
    assert finished.prompt_tokens + finished.completion_tokens == 512
    assert len(ids) == 12


KILLED_GATEWAY = textwrap.dedent("""
    import asyncio, sys
    from gateway.worker_client import WorkerClient
    from shared.protocol import Generate
    from shared.sampling_params import SamplingParams
    async def main():
        client = WorkerClient(sys.argv[1])
        await client.start()
        await client.wait_ready(60)
        request = Generate("doomed", [1, 2, 3, 4], SamplingParams(temperature=1.0, seed=0), 3000, stop_ids=[])
        async for message in client.generate(request):
            print("token", flush=True)
    asyncio.run(main())
""")


def test_a_killed_gateways_requests_are_freed(batch_worker):
    gateway = subprocess.Popen([sys.executable, "-c", KILLED_GATEWAY, batch_worker.endpoint], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert gateway.stdout.readline().strip() == "token"
    finally:
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.wait()

    async def load_after_timeout():
        client = await _client(batch_worker.endpoint)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                if client.worker_load == (0, 0):
                    return client.worker_load
            return client.worker_load
        finally:
            await client.close()
    assert run(load_after_timeout()) == (0, 0)


def test_a_dead_worker_fails_in_flight_requests_and_a_new_one_is_found(start_worker, default_model):
    worker = start_worker(default_model, "--ctx", "256")

    async def go():
        client = WorkerClient(worker.endpoint, heartbeat_interval=0.3, heartbeat_timeout=1.5)
        await client.start()
        await client.wait_ready(60)
        first_instance = client.card.instance
        stream = client.generate(Generate(client.new_request_id(), [1, 2, 3], SamplingParams(temperature=1.0, seed=0),
                                          200, stop_ids=[]))
        assert isinstance(await stream.__anext__(), Accepted)
        assert isinstance(await stream.__anext__(), Tokens)
        worker.kill()
        with pytest.raises(WorkerUnavailableError):
            async for _ in stream:
                pass
        with pytest.raises(WorkerUnavailableError):
            await collect(client, _greedy(client, [1, 2], 2))
        worker.start()  # same endpoint: the client must find it by itself
        await client.wait_ready(120)
        ids, finished = await collect(client, _greedy(client, [1, 2, 3], 3))
        await client.close()
        return first_instance, client.card.instance, finished
    first, second, finished = run(go())
    assert first != second
    assert finished.reason == "length"


def test_a_reader_that_falls_behind_is_cut_off_and_frees_the_worker(batch_worker):
    async def go():
        client = WorkerClient(batch_worker.endpoint, max_buffered=8)
        await client.start()
        await client.wait_ready(60)
        try:
            rid = client.new_request_id()
            stream = client.generate(Generate(rid, [1, 2, 3], SamplingParams(temperature=1.0, seed=0), 500,
                                              stop_ids=[]))
            assert isinstance(await stream.__anext__(), Accepted)
            for _ in range(600):  # read nothing while the worker produces, until the client gives up
                if client.was_cut_off(rid):
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(Exception, match="too slowly"):
                async for _ in stream:
                    pass
            for _ in range(50):
                await asyncio.sleep(0.2)
                if client.worker_load == (0, 0):
                    break
            return client.worker_load
        finally:
            await client.close()
    assert run(go()) == (0, 0)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(batch_worker):
    """The worker runs --prefill-chunk 256: a 1,500-token prompt needs 6 steps, and the stream
    already decoding gets a token in each of them before the long one's first token."""
    async def go():
        client = await _client(batch_worker.endpoint)
        try:
            order: list[str] = []
            started = asyncio.Event()

            async def runner():
                request = Generate(client.new_request_id(), [1, 2, 3], SamplingParams(temperature=1.0, seed=2), 120,
                                   stop_ids=[])
                async for message in client.generate(request):
                    if isinstance(message, Tokens):
                        order.append("short")
                        started.set()

            async def long_one():
                await started.wait()
                prompt = np.random.default_rng(9).integers(100, 40000, 1500).tolist()
                request = Generate(client.new_request_id(), prompt, SamplingParams(temperature=0.0), 2)
                async for message in client.generate(request):
                    if isinstance(message, Accepted):
                        order.append("accepted")
                    elif isinstance(message, Tokens):
                        order.append("long")

            await asyncio.gather(runner(), long_one())
            return order
        finally:
            await client.close()
    order = run(go())
    between = order[order.index("accepted"):order.index("long")]
    assert between.count("short") >= 4, order


def test_a_restarted_worker_is_noticed_and_greeted_at_once(start_worker, default_model):
    """The connection dropping tells the client at once (no wait for the heartbeat timeout), and
    it says HELLO as soon as the connection is back (no wait for its next heartbeat)."""
    worker = start_worker(default_model, "--ctx", "256")

    async def go():
        client = WorkerClient(worker.endpoint, heartbeat_interval=60.0, heartbeat_timeout=300.0)
        await client.start()
        await client.wait_ready(60)
        first_instance = client.card.instance
        worker.kill()
        for _ in range(100):
            if not client.ready:
                break
            await asyncio.sleep(0.05)
        gone = not client.ready
        worker.start()
        await asyncio.get_running_loop().run_in_executor(None, worker.wait_ready)
        await client.wait_ready(20)  # far less than the 60 s heartbeat
        ids, finished = await collect(client, _greedy(client, [1, 2, 3], 3))
        await client.close()
        return gone, first_instance, client.card.instance, finished
    gone, first, second, finished = run(go())
    assert gone and first != second
    assert finished.reason == "length"


def test_a_request_from_an_ungreeted_gateway_is_sent_back_for_hello(sequential_worker):
    """A worker that restarted under a gateway that did not notice: its GENERATE is answered
    REJECTED hello_first, so the gateway greets and resends it (WorkerClient.generate)."""
    from shared.protocol import HELLO_FIRST, Rejected, decode

    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sequential_worker.endpoint)
    try:
        dealer.send_multipart(Generate("never-greeted-1", [1, 2, 3], max_tokens=2).frames())
        assert dealer.poll(10000)
        reply = decode(dealer.recv_multipart())
        assert isinstance(reply, Rejected) and reply.kind == HELLO_FIRST and reply.request_id == "never-greeted-1"
    finally:
        dealer.close(0)


@pytest.mark.parametrize("body, request_id, words", [
    ({"request_id": {"not": "a string"}, "max_tokens": 2}, "", "request_id must be a string, not a map"),
    ({"request_id": "typed-1", "max_tokens": "2"}, "typed-1", "max_tokens must be an integer, not a string"),
    ({"request_id": "typed-2", "sampling": {"top_k": [40]}}, "typed-2", "sampling.top_k must be an integer, not a list"),
    ({"request_id": "typed-3", "stop_ids": [2, {}]}, "typed-3", "stop_ids[1] must be an integer, not a map"),
])
def test_a_malformed_generate_is_rejected_naming_the_field(sequential_worker, body, request_id, words):
    """Sent by a greeted gateway over the real wire, a GENERATE with a field of the wrong type is
    answered REJECTED (under "" when its request id is no string), and the worker serves on."""
    from shared.protocol import ModelCard, Rejected, decode

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sequential_worker.endpoint)

    def reply(kind: type) -> object:
        deadline = time.monotonic() + 30
        while dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = decode(dealer.recv_multipart())
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within 30 s")

    try:
        dealer.send_multipart(Hello(gateway="raw-dealer").frames())
        reply(ModelCard)
        dealer.send_multipart([MsgType.GENERATE.value, msgpack.packb(body), np.array([1, 2, 3], "<i4").tobytes()])
        rejected = reply(Rejected)
        assert (rejected.request_id, rejected.status, rejected.message) == (request_id, 400, words)
        dealer.send_multipart(Generate("after-it", [1, 2, 3], max_tokens=1).frames())
        assert reply(Accepted).request_id == "after-it"
        assert reply(Finished).request_id == "after-it"  # done before the next case's gateway asks
    finally:
        dealer.close(0)


def _packed(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


PROMPT_IDS = np.array([1, 2, 3], "<i4").tobytes()
# GENERATEs that name their request: each answered REJECTED under that id, with the reason
REFUSED_GENERATES = [
    ([b"G", _packed({"request_id": "wire-1", "grammar": {"kind": "cobol", "source": ""}}), PROMPT_IDS],
     "wire-1", "grammar.kind must be one of"),
    ([b"G", _packed({"request_id": "wire-2", "sampling": {"temperature": "hot"}}), PROMPT_IDS],
     "wire-2", "sampling.temperature must be a number, not a string"),
    ([b"G", _packed({"request_id": "wire-3"})], "wire-3", "exactly one int32 frame of prompt ids"),
    ([b"G", _packed({"request_id": "wire-4", "max_tokens": None}), PROMPT_IDS],
     "wire-4", "max_tokens must be an integer, not nil"),
    ([b"G", _packed({"max_tokens": 2}), PROMPT_IDS], "", "request_id is missing"),
]
# everything else that does not parse, of every type: dropped with a log line
DROPPED = [
    *[[kind, _packed([1, 2])] for kind in sorted(m.value for m in MsgType)],  # a body that is no map
    [b"H", _packed({"version": "3", "gateway": "raw"})],
    [b"C", _packed({"version": PROTOCOL_VERSION, "model_id": "m"})],
    [b"A", _packed({"request_id": "wire-5", "queue_position": "first"})],
    [b"B", _packed({"request_id": "wire-5", "retry_after": "soon"})],
    [b"R", _packed({"request_id": "wire-5", "status": "bad"})],
    [b"T", _packed({"request_id": "wire-5", "ids": "many"})],
    [b"F", _packed({"request_id": "wire-5", "reason": "tired"})],
    [b"X", _packed({"request_id": ["wire-5"]})],
    [b"P", _packed({"sent_at": "now"})],
    [b"Z", _packed({})],  # no such type
    [b"G", b"\xc1"],  # no msgpack
    [b"G"],  # no body
]


def test_every_malformed_message_is_refused_or_dropped_and_the_worker_serves_on(sequential_worker):
    """One gateway sends a malformed message of every type over the real wire: a GENERATE that
    names its request is answered REJECTED with the reason, the rest are dropped with a line in
    the worker's log, and a good GENERATE after them all is served."""
    from shared.protocol import ModelCard, Rejected, decode

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if sequential_worker.wire is not None:  # a fixture's worker on a CURVE wire
        wire = sequential_worker.wire
        dealer.curve_secretkey, dealer.curve_publickey, dealer.curve_serverkey = wire.secret, wire.public, wire.server
    dealer.connect(sequential_worker.endpoint)
    logged_before = sequential_worker.log_path.read_text().count("dropping a malformed message")

    def replies_until(kind: type) -> list:
        seen, deadline = [], time.monotonic() + 30
        while dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = decode(dealer.recv_multipart())
            seen.append(message)
            if isinstance(message, kind):
                return seen
        raise AssertionError(f"no {kind.__name__} within 30 s; got {seen}")

    try:
        dealer.send_multipart(Hello(gateway="malformed-peer").frames())
        replies_until(ModelCard)
        for frames in DROPPED:
            dealer.send_multipart(frames)
        refused = []
        for frames, request_id, words in REFUSED_GENERATES:
            dealer.send_multipart(frames)
            refused.append((replies_until(Rejected)[-1], request_id, words))
        dealer.send_multipart(Generate("served-after", [1, 2, 3], SamplingParams(temperature=0.0), 2).frames())
        served = [m for m in replies_until(Finished) if not isinstance(m, Heartbeat)]
    finally:
        dealer.close(0)
    for rejected, request_id, words in refused:
        assert (rejected.request_id, rejected.status) == (request_id, 400) and words in rejected.message, rejected
    accepted, *streamed, finished = served
    assert isinstance(accepted, Accepted) and all(isinstance(m, Tokens) for m in streamed), served
    assert finished.request_id == "served-after" and finished.reason == "length"
    assert sum(len(m.ids) for m in streamed) == finished.completion_tokens == 2
    logged = sequential_worker.log_path.read_text().count("dropping a malformed message")
    assert logged - logged_before == len(DROPPED)
