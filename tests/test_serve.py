"""``lmserve serve``: the one-command stack answers the reference README's curl examples."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from conftest import REPO, free_port


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "lmserve serve exited"
        time.sleep(0.3)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    log.close()


def test_curl_examples_from_the_reference_readme(served):
    _, url = served
    http = httpx.Client(base_url=url, timeout=120)
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    responses = http.post("/v1/responses", json={"input": "Hi!", "instructions": "Answer in one sentence.",
                                                 "max_output_tokens": 16})
    assert responses.status_code == 200 and responses.json()["output"][0]["content"][0]["text"]
    messages = http.post("/v1/messages", json={"model": "any", "max_tokens": 16, "system": "Answer in one sentence.",
                                               "messages": [{"role": "user", "content": "Hi!"}]})
    assert messages.status_code == 200 and messages.json()["content"][0]["text"]
    # the reference README: reasoning is rejected when the model has no reasoning channel
    reasoning = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is 17*23?"}],
                                                       "reasoning_effort": "low"})
    assert reasoning.status_code == 400
    assert http.get("/v1/models").json()["data"][0]["id"].startswith("SmolLM2")
    assert http.get("/health").json()["status"] == "ok"


def test_ctrl_c_stops_every_child(served):
    proc, url = served
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2  # a worker and a gateway
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned: {alive}"
