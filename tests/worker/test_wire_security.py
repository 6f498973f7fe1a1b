"""The worker wire is CURVE: a peer without an allowed key gets no card and no tokens, through
real worker and gateway processes and raw ZeroMQ sockets."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import zmq
import zmq.auth
from conftest import REPO, free_port, run, wait_until

from bench.faults import wire_outsider

from gateway.worker_client import WorkerClient
from launcher.cli import main as lmserve
from shared.protocol import Finished, Generate, MsgType, Tokens
from shared.sampling_params import SamplingParams
from shared.wire_security import ClientKeys, is_loopback_endpoint

SILENCE_MS = 3000  # how long an outsider waits for an answer that must not come


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    assert lmserve(["keys", "--dir", str(folder), "worker", "gateway", "stranger"]) == 0
    return folder


def client_keys(keys, who: str = "gateway", server: str = "worker") -> ClientKeys:
    public, secret = zmq.auth.load_certificate(keys / f"{who}.key_secret")
    return ClientKeys(public, secret, zmq.auth.load_certificate(keys / f"{server}.key")[0])


@pytest.fixture(scope="module")
def secured(start_worker, default_model, keys):
    return start_worker(default_model, "--wire-key", str(keys / "worker.key_secret"),
                        "--wire-allow", str(keys / "gateway.key"), "--ctx", "1024", wire=client_keys(keys))


def test_key_files_are_private_and_never_replaced(keys):
    assert (keys / "worker.key_secret").stat().st_mode & 0o777 == 0o600
    assert (keys / "worker.key").stat().st_mode & 0o777 == 0o644
    before = (keys / "worker.key_secret").read_bytes()
    assert lmserve(["keys", "--dir", str(keys), "worker"]) == 2
    assert (keys / "worker.key_secret").read_bytes() == before


def test_a_peer_without_curve_gets_nothing(secured):
    assert wire_outsider(secured.endpoint, None, SILENCE_MS) is None


def test_a_peer_whose_key_is_not_allowed_gets_nothing(secured, keys):
    assert wire_outsider(secured.endpoint, client_keys(keys, who="stranger"), SILENCE_MS) is None


def test_a_gateway_expecting_another_worker_key_talks_to_no_impostor(secured, keys):
    assert wire_outsider(secured.endpoint, client_keys(keys, server="stranger"), SILENCE_MS) is None


def test_the_allowed_gateway_gets_its_card_and_tokens(secured, keys):
    async def ask():
        client = WorkerClient(secured.endpoint, wire=client_keys(keys))
        await client.start()
        try:
            card = await client.wait_ready(30)
            ids = []
            async for message in client.generate(Generate(client.new_request_id(), [1, 504, 3], SamplingParams(
                    temperature=0.0), 4)):
                if isinstance(message, Tokens):
                    ids += message.ids
                elif isinstance(message, Finished):
                    return card, ids, message
        finally:
            await client.close()

    card, ids, finished = run(ask())
    assert card.model_id.startswith("SmolLM2")
    assert len(ids) == finished.completion_tokens > 0
    # the raw protocol's own HELLO works too, given the keys: the refusals above were the keys'
    assert wire_outsider(secured.endpoint, client_keys(keys)) == MsgType.MODEL_CARD.value


def test_the_sdk_through_a_gateway_holding_the_keys(start_gateway, secured, keys):
    gateway = start_gateway(secured, "--wire-key", str(keys / "gateway.key_secret"),
                            "--worker-key", str(keys / "worker.key"))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="any", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.completion_tokens > 0


def _unready_reason(gateway) -> str:
    """What a gateway's /health says keeps it from serving, once it says something."""
    said = {}

    def says() -> bool:
        try:
            response = httpx.get(gateway.url + "/health", timeout=10)
        except httpx.ConnectError:  # not listening yet
            return False
        said.update(response.json())
        return response.status_code == 503 and bool(said.get("error"))

    assert wait_until(says, timeout=30), f"/health said {said}"
    return said["error"]


@pytest.mark.parametrize("worker, who, server, says", [
    ("secured", "stranger", "worker",
     "refused this gateway's key: list the gateway's public key in the worker's --wire-allow"),
    ("secured", "gateway", "stranger",
     "the worker needs a --wire-key, and this gateway's --worker-key must be its public half"),
    ("secured", None, None, "a worker with --wire-key answers only a gateway given --wire-key and --worker-key"),
    ("stack_worker", "gateway", "worker",  # a worker on loopback without keys
     "the worker needs a --wire-key, and this gateway's --worker-key must be its public half"),
])
def test_a_gateway_holding_the_wrong_keys_says_which(request, start_gateway, keys, worker, who, server, says):
    flags = () if who is None else ("--wire-key", str(keys / f"{who}.key_secret"), "--worker-key",
                                    str(keys / f"{server}.key"))
    gateway = start_gateway(request.getfixturevalue(worker), *flags, wait=False)
    assert says in _unready_reason(gateway)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="any", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 503 and says in refused.value.message


def test_a_refused_gateway_finds_the_worker_restarted_with_its_key(start_worker, start_gateway, default_model, keys):
    """libzmq never connects again after a refused handshake: the gateway does, so fixing the
    worker's --wire-allow is enough."""
    secret = str(keys / "worker.key_secret")
    strangers_only = start_worker(default_model, "--wire-key", secret, "--wire-allow", str(keys / "stranger.key"),
                                  "--ctx", "1024", wire=client_keys(keys, who="stranger"))
    gateway = start_gateway(strangers_only, "--wire-key", str(keys / "gateway.key_secret"),
                            "--worker-key", str(keys / "worker.key"), wait=False)
    assert "refused this gateway's key" in _unready_reason(gateway)
    strangers_only.stop()
    start_worker(default_model, "--wire-key", secret, "--wire-allow", str(keys / "gateway.key"), "--ctx", "1024",
                 wire=client_keys(keys), endpoint=strangers_only.endpoint)
    gateway.wait_ready()
    reply = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused").chat.completions.create(
        model="any", max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.completion_tokens > 0


@pytest.mark.parametrize("flags, says", [
    ((), "--wire-key"),
    (("--wire-allow", "ignored"), "--wire-allow needs --wire-key"),
])
def test_a_worker_without_keys_on_a_reachable_endpoint_refuses_to_start(default_model, flags, says):
    result = subprocess.run([sys.executable, "-m", "launcher.cli", "worker", str(default_model), "--worker",
                             f"tcp://0.0.0.0:{free_port()}", *flags], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert says in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("ipc:///tmp/lmserve.sock", True), ("tcp://127.0.0.1:1,ipc:///tmp/x", True),
    ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.0.0.5:5557", False),
    ("tcp://127.evil.example:5557", False), ("dns+tcp://worker:5557", False),
    ("tcp://127.0.0.1:1,tcp://10.0.0.5:2", False),
])
def test_which_endpoints_stay_on_this_machine(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local
