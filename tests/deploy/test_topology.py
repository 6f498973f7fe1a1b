"""The docker-compose topology, run for real with processes on loopback ports: Redis, one worker,
three gateways and Debian's nginx in front, configured from deploy/nginx.conf, and secured as
compose secures it: keys from ``lmserve keys``, a CURVE wire, a Redis password.

What must hold: streams in all three dialects pass through nginx, spread over the gateways; a
gateway killed mid-run costs at most the streams it was serving; a restarted worker is found
again by the gateways on their own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
import redis as redis_client
import zmq.auth
from access_logs import access_entries
from conftest import GatewayProcess, WorkerProcess, wait_until
from deploy_helpers import NginxProcess

from launcher.cli import main as lmserve
from shared.wire_security import ClientKeys

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


@dataclass
class Topology:
    redis: object
    worker: WorkerProcess
    gateways: list[GatewayProcess]
    nginx: NginxProcess

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.nginx.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.nginx.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def topology(start_redis, start_worker, start_gateway, default_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    assert lmserve(["keys", "--dir", str(keys), "worker", "gateway", "--kv-secret", str(keys / "kv-secret"),
                    "--redis-password", str(keys / "redis-password")]) == 0
    password = (keys / "redis-password").read_text().strip()
    redis = start_redis(password=password)
    public, secret = zmq.auth.load_certificate(keys / "gateway.key_secret")
    wire = ClientKeys(public, secret, zmq.auth.load_certificate(keys / "worker.key")[0])
    worker = start_worker(default_model, "--batch", "4", "--kv-slots", "4", "--ctx", "1024",
                          "--kv-store", redis.url.replace("redis://", f"redis://:{password}@"),
                          "--wire-key", str(keys / "worker.key_secret"), "--wire-allow", str(keys / "gateway.key"),
                          "--kv-secret", str(keys / "kv-secret"), wire=wire)
    gateways = [start_gateway(worker, "--log-format", "json", "--wire-key", str(keys / "gateway.key_secret"),
                              "--worker-key", str(keys / "worker.key"), wait=False) for _ in range(3)]
    for gateway in gateways:  # started together, awaited together
        gateway.wait_ready()
    nginx = NginxProcess(tmp_path_factory.mktemp("nginx"), [f"127.0.0.1:{g.port}" for g in gateways]).start()
    nginx.wait_ready()
    yield Topology(redis, worker, gateways, nginx)
    nginx.stop()


def _served_requests(gateway: GatewayProcess) -> list[dict]:
    return access_entries(gateway.log_path, dialects_only=True)


def _chat_stream(top: Topology) -> tuple[str, str]:
    stream = top.openai().chat.completions.create(model="m", messages=QUESTION, max_tokens=8, stream=True)
    gateway = stream.response.headers["x-lmserve-gateway"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return gateway, text


def _responses_stream(top: Topology) -> tuple[str, str]:
    with top.openai().responses.stream(model="m", input="Name the capital city of France.",
                                       max_output_tokens=8) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    return "", text


def _messages_stream(top: Topology) -> tuple[str, str]:
    with top.anthropic().messages.stream(model="m", max_tokens=8, messages=QUESTION) as stream:
        gateway = stream.response.headers["x-lmserve-gateway"]
        text = "".join(stream.text_stream)
    return gateway, text


def test_redis_is_up_beside_the_stack(topology):
    with pytest.raises(redis_client.exceptions.AuthenticationError):  # no password, no entry
        redis_client.Redis.from_url(topology.redis.url, socket_timeout=5).ping()
    assert redis_client.Redis.from_url(topology.redis.url, password=topology.redis.password,
                                       socket_timeout=5).ping() is True


def test_streams_in_three_dialects_spread_over_the_gateways(topology):
    calls = [_chat_stream, _responses_stream, _messages_stream]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda call: call(topology), calls))
    assert all(text for _, text in results), results
    pids = {str(g.proc.pid) for g in topology.gateways}
    assert all(gateway.rsplit(":", 1)[1] in pids for gateway, _ in results if gateway)

    # nginx takes turns: each gateway logged one of them, each in its dialect
    assert wait_until(lambda: sum(len(_served_requests(g)) for g in topology.gateways) >= 3)
    per_gateway = [_served_requests(g) for g in topology.gateways]
    assert all(per_gateway), [len(entries) for entries in per_gateway]
    entries = [e for served in per_gateway for e in served]
    assert sorted(e["dialect"] for e in entries) == ["anthropic", "chat", "responses"]
    assert all(e["status"] == 200 and e["stream"] and e["completion_tokens"] > 0 for e in entries)


@dataclass
class Outcome:
    started: float
    gateway: str | None  # from the response header, when the answer got that far
    error: str | None


def test_a_killed_gateway_costs_only_its_own_streams(topology):
    victim = topology.gateways[0]
    victim_id = f":{victim.proc.pid}"
    outcomes: list[Outcome] = []
    killed_at: list[float] = []
    lock = threading.Lock()

    def client_loop(rounds_after_kill: int) -> None:
        done_after_kill = 0
        while done_after_kill < rounds_after_kill:
            started, gateway, error = time.monotonic(), None, None
            try:
                stream = topology.openai().chat.completions.create(
                    model="m", messages=QUESTION, max_tokens=6, stream=True)
                gateway = stream.response.headers["x-lmserve-gateway"]
                if not "".join(c.choices[0].delta.content or "" for c in stream if c.choices):
                    error = "empty answer"
            except (openai.APIError, httpx.HTTPError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            with lock:
                outcomes.append(Outcome(started, gateway, error))
                if killed_at and started > killed_at[0]:
                    done_after_kill += 1

    threads = [threading.Thread(target=client_loop, args=(2,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: len(outcomes) >= 3, timeout=60)
    with lock:
        killed_at.append(time.monotonic())
    os.kill(victim.proc.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)

    before = [o for o in outcomes if o.started <= killed_at[0]]
    after = [o for o in outcomes if o.started > killed_at[0]]
    assert len(after) >= 6
    assert all(o.error is None for o in after), [o.error for o in after if o.error]
    assert not any(o.gateway and o.gateway.endswith(victim_id) for o in after)
    # what failed was on the killed gateway (or never got far enough to say where it was)
    for outcome in before:
        if outcome.error is not None:
            assert outcome.gateway is None or outcome.gateway.endswith(victim_id), outcome
    assert victim.proc.wait(10) == -signal.SIGKILL


def test_gateways_find_a_restarted_worker_by_themselves(topology):
    alive = [g for g in topology.gateways if g.proc.poll() is None]
    assert len(alive) >= 2

    def health(gateway: GatewayProcess) -> int:
        try:
            return httpx.get(gateway.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    topology.worker.kill()
    assert wait_until(lambda: all(health(g) == 503 for g in alive), timeout=30)
    topology.worker.start()  # the same endpoint; the gateways are not told
    topology.worker.wait_ready()
    assert wait_until(lambda: all(health(g) == 200 for g in alive), timeout=60)
    assert all(g.proc.poll() is None for g in alive)
    for call in (_chat_stream, _messages_stream):
        _, text = call(topology)
        assert text
