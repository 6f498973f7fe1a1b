"""The HTTP edge: probes, models, auth, Host guard, caps, admission and disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from conftest import wait_until

http = httpx.Client(timeout=60)  # first requests to a fresh gateway can be slow on a loaded machine

PARIS = [{"role": "user", "content": "Name the capital city of France."}]
# keep SmolLM2 talking: forbid its end-of-turn tokens (<|endoftext|> 0, <|im_end|> 2); 1000 tokens fit
# the smallest --ctx here (1024): a longer reply than the context is a 400 in the OpenAI dialects
ENDLESS = {"model": "m", "messages": PARIS, "max_tokens": 1000, "stream": True,
           "temperature": 1.0, "seed": 7, "logit_bias": {"0": -100, "2": -100}}


def test_probes_and_health(stack):
    assert http.head(stack.url + "/").status_code == 200
    assert http.head(stack.url + "/api/hello").status_code == 200
    health = http.get(stack.url + "/health").json()
    assert health["status"] == "ok" and health["model"].startswith("SmolLM2")


def test_models_body_satisfies_both_sdks(stack):
    openai_models = openai.OpenAI(base_url=stack.url + "/v1", api_key="x").models.list()
    anthropic_models = anthropic.Anthropic(base_url=stack.url, api_key="x").models.list()
    assert [m.id for m in openai_models.data] == [m.id for m in anthropic_models.data]
    assert openai_models.data[0].id.startswith("SmolLM2")


def test_unknown_paths_are_404_in_the_callers_dialect(stack):
    plain = http.get(stack.url + "/v2/nothing")
    assert plain.status_code == 404 and plain.json()["error"]["type"] == "invalid_request_error"
    anthropic_style = http.post(stack.url + "/v1/messages/nothing", json={})
    assert anthropic_style.status_code == 404
    assert anthropic_style.json()["type"] == "error"
    assert anthropic_style.json()["error"]["type"] == "not_found_error"
    wrong_method = http.get(stack.url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_health_is_503_until_the_worker_answers(start_gateway, stack_worker):
    # a gateway pointed at a port where no worker listens
    class Nowhere:
        endpoint = "tcp://127.0.0.1:9"
    lonely = start_gateway(Nowhere, wait=False)
    assert wait_until(lambda: _status(lonely.url + "/health") == 503, 30)
    chat = http.post(lonely.url + "/v1/chat/completions", json={"model": "m", "messages": PARIS})
    assert chat.status_code == 503 and chat.json()["error"]["type"] == "server_error"
    messages = http.post(lonely.url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": PARIS})
    assert messages.status_code == 529 and messages.json()["error"]["type"] == "overloaded_error"


def _status(url: str) -> int | None:
    try:
        return http.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def keyed(start_gateway, stack_worker):
    return start_gateway(stack_worker, "--api-key", "s3cret")


def test_api_key_bearer_or_x_api_key(keyed):
    body = {"model": "m", "messages": PARIS, "max_tokens": 2}
    missing = http.post(keyed.url + "/v1/chat/completions", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = http.post(keyed.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert http.post(keyed.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert http.post(keyed.url + "/v1/chat/completions", json=body,
                      headers={"x-api-key": "s3cret"}).status_code == 200
    anthropic_missing = http.post(keyed.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": PARIS})
    assert anthropic_missing.status_code == 401
    assert anthropic_missing.json()["error"]["type"] == "authentication_error"
    assert http.get(keyed.url + "/health").status_code == 200  # probes stay open
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=PARIS)
    ok = anthropic.Anthropic(base_url=keyed.url, api_key="s3cret", max_retries=0).messages.create(
        model="m", max_tokens=2, messages=PARIS)
    assert ok.usage.output_tokens == 2


def test_host_guard_on_a_loopback_bind(stack, start_gateway, stack_worker):
    evil = http.get(stack.url + "/v1/models", headers={"host": "evil.example:8080"})
    assert evil.status_code == 403 and "DNS-rebinding" in evil.json()["error"]["message"]
    assert http.get(stack.url + "/v1/models", headers={"host": "localhost:1234"}).status_code == 200
    assert http.get(stack.url + "/v1/models", headers={"host": "[::1]:1234"}).status_code == 200
    widened = start_gateway(stack_worker, "--allow-host", "lmserve.internal")
    assert http.get(widened.url + "/v1/models", headers={"host": "lmserve.internal"}).status_code == 200
    assert http.get(widened.url + "/v1/models", headers={"host": "evil.example"}).status_code == 403


@pytest.mark.parametrize("host", ["127.0.0.1:1@evil.com", "[localhost]", "[::1]evil", "localhost:80:80",
                                  "127.0.0.1 evil.com", "[]", ":80"])
def test_the_host_guard_reads_one_host_and_one_port_only(stack, host):
    refused = http.get(stack.url + "/v1/models", headers={"host": host})
    assert refused.status_code in (400, 403), host  # h11 itself refuses the most broken ones
    assert refused.json()["error"]["type"] in ("permission_error", "invalid_request_error")


def _raw(url: str, request: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are and read the reply until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/models HTTP/1.1\r\n\r\n",  # no Host
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.com\r\n\r\n",  # two
    b"GET /v1/models HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",  # a broken request line
])
def test_requests_that_are_not_http_get_a_json_400(stack, request_bytes):
    reply = _raw(stack.url, request_bytes)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert "not valid HTTP/1.1" in json.loads(body)["error"]["message"]


def test_a_repeated_key_header_is_refused_whichever_comes_last(keyed):
    body = {"model": "m", "messages": PARIS, "max_tokens": 2}
    for pair in (["Bearer s3cret", "Bearer nope"], ["Bearer nope", "Bearer s3cret"]):
        headers = httpx.Headers([("authorization", value) for value in pair])
        refused = http.post(keyed.url + "/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 400 and "repeats the authorization header" in refused.json()["error"]["message"]
    for pair in (["s3cret", "nope"], ["nope", "s3cret"]):
        headers = httpx.Headers([("x-api-key", value) for value in pair] + [("anthropic-version", "2023-06-01")])
        refused = http.post(keyed.url + "/v1/messages", json={**body, "max_tokens": 2}, headers=headers)
        assert refused.status_code == 400 and refused.json()["type"] == "error"
    # one of each, one of them a placeholder: the right key in either is enough
    both = http.post(keyed.url + "/v1/chat/completions", json=body,
                     headers={"x-api-key": "placeholder", "authorization": "Bearer s3cret"})
    assert both.status_code == 200


def test_headers_that_trickle_in_are_cut_off(start_gateway, stack_worker):
    """A slowloris client sends a header line every 0.3 s forever: with --header-timeout 1 the
    gateway answers 408 and closes; a normal request on the same gateway is untouched."""
    gateway = start_gateway(stack_worker, "--header-timeout", "1")
    host, port = gateway.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        reply = b""
        try:
            for i in range(60):  # 18 s of trickling, unless the server hangs up first
                sock.sendall(b"X-Slow-%d: y\r\n" % i)
                time.sleep(0.3)
        except OSError:  # the server closed the connection
            pass
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    assert time.monotonic() - started < 10
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply
    # a connection that never sends a byte is cut as well
    with socket.create_connection((host, int(port)), timeout=20) as silent:
        started = time.monotonic()
        assert silent.recv(65536).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < 10
    assert http.get(gateway.url + "/health").status_code == 200


def test_body_cap_is_413_in_the_envelope(start_gateway, stack_worker):
    small = start_gateway(stack_worker, "--max-body", "2000")
    big = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 5000}]}
    declared = http.post(small.url + "/v1/messages", json=big)
    assert declared.status_code == 413 and declared.json()["error"]["type"] == "request_too_large"

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i:i + 500]
    streamed = http.post(small.url + "/v1/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "limit of 2000 bytes" in streamed.json()["error"]["message"]


def _worker_running(url: str) -> int:
    return http.get(url + "/health").json()["worker"]["running"]


def test_disconnect_mid_stream_frees_the_worker(stack):
    assert wait_until(lambda: _worker_running(stack.url) == 0, 30)
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=ENDLESS, timeout=60) as response:
        lines = response.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
        # still connected (not reading): the worker keeps generating
        assert wait_until(lambda: _worker_running(stack.url) >= 1, 10)
        time.sleep(1.5)
        assert _worker_running(stack.url) >= 1
    # leaving the block closes the connection: the gateway must abort the request in the worker
    assert wait_until(lambda: _worker_running(stack.url) == 0, 20)


def test_disconnect_before_a_non_streamed_answer_frees_the_worker(stack):
    assert wait_until(lambda: _worker_running(stack.url) == 0, 30)
    body = {**ENDLESS, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        http.post(stack.url + "/v1/chat/completions", json=body, timeout=2.0)
    assert wait_until(lambda: _worker_running(stack.url) == 0, 20)


@pytest.fixture(scope="module")
def tight(start_worker, start_gateway, default_model):
    """A worker that lets nothing wait, a gateway in front of it, and one capped at 1 connection."""
    worker = start_worker(default_model, "--queue", "0", "--ctx", "1024")
    return start_gateway(worker), start_gateway(worker, "--conns", "1")


class Held:
    """An endless stream held open on a background thread until released."""

    def __init__(self, url: str):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(url,))
        self.thread.start()

    def _hold(self, url: str) -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=ENDLESS, timeout=60) as response:
            for _ in response.iter_lines():
                if self.stop.is_set():
                    return

    def release(self) -> None:
        self.stop.set()
        self.thread.join(30)


def test_full_queue_is_429_with_retry_after(tight):
    gateway, _ = tight
    held = Held(gateway.url)
    try:
        assert wait_until(lambda: _worker_running(gateway.url) == 1, 30)
        chat = http.post(gateway.url + "/v1/chat/completions", json={"model": "m", "messages": PARIS, "max_tokens": 2})
        assert chat.status_code == 429 and chat.headers["retry-after"] == "1"
        assert chat.json()["error"]["type"] == "rate_limit_error"
        assert "queue is full" in chat.json()["error"]["message"]
        with pytest.raises(anthropic.RateLimitError):
            anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0).messages.create(
                model="m", max_tokens=2, messages=PARIS)
    finally:
        held.release()
    assert wait_until(lambda: _worker_running(gateway.url) == 0, 20)
    assert http.post(gateway.url + "/v1/chat/completions",
                      json={"model": "m", "messages": PARIS, "max_tokens": 2}).status_code == 200


def test_connection_cap_is_429_in_the_envelope(tight):
    _, capped = tight
    held = Held(capped.url)
    try:
        assert wait_until(lambda: _active(capped.url) == 429, 30)
        refused = http.post(capped.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": PARIS})
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "connection limit (1" in refused.json()["error"]["message"]
    finally:
        held.release()
    assert wait_until(lambda: _active(capped.url) == 200, 20)


def _active(url: str) -> int:
    return http.get(url + "/v1/models").status_code
