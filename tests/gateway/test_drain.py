"""A gateway stopped while replies stream: each one that outlives --drain-timeout ends with an
error event in its own dialect (not a dropped connection), the worker stops generating it, and
the gateway process exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

NO_END = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end-of-turn ids: the reply runs to max_tokens
LONG = 1500  # tokens: far more than fit in the drain timeout
REQUESTS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a long story."}],
                             "max_tokens": LONG, "logit_bias": NO_END, "stream": True},
    # a grammar that cannot be complete before thousands of characters: no early end either
    "/v1/responses": {"input": "Tell me a long story.", "max_output_tokens": LONG, "stream": True,
                      "grammar": {"type": "regex", "definition": "[a-z ]{5000}"}},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
                     "max_tokens": LONG, "stream": True, "grammar": {"type": "regex", "definition": "[a-z ]{5000}"}},
}


def _read(url: str, path: str, body: dict[str, Any], started: threading.Event, out: dict[str, Any]) -> None:
    data: list[dict[str, Any]] = []
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data.append(json.loads(line[len("data: "):]))
                    if len(data) >= 6:
                        started.set()
                elif line == "data: [DONE]":
                    data.append({"done": True})
        out["ended"] = "cleanly"
    except httpx.HTTPError as exc:
        out["ended"] = f"dropped: {exc!r}"
    finally:
        out["data"] = data
        started.set()


def test_replies_past_the_drain_timeout_end_in_their_dialect(start_gateway, stack_worker, stack):
    gateway = start_gateway(stack_worker, "--drain-timeout", "2")
    results: dict[str, dict[str, Any]] = {path: {} for path in REQUESTS}
    threads = []
    for path, body in REQUESTS.items():
        started = threading.Event()
        thread = threading.Thread(target=_read, args=(gateway.url, path, body, started, results[path]))
        thread.start()
        assert started.wait(60), path
        threads.append(thread)
    began = time.monotonic()
    gateway.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: exit by SIGTERM
    assert gateway.proc.wait(30) in (0, -signal.SIGTERM)
    assert time.monotonic() - began < 15

    for path, result in results.items():
        assert result["status"] == 200 and result["ended"] == "cleanly", (path, result.get("ended"))
        last = result["data"][-1]
        if path == "/v1/chat/completions":
            last = result["data"][-2] if last.get("done") else last
            assert last["error"]["code"] == "service_unavailable", last
            message = last["error"]["message"]
        elif path == "/v1/responses":
            assert last["type"] == "response.failed", last
            message = last["response"]["error"]["message"]
        else:
            assert last["type"] == "error" and last["error"]["type"] == "overloaded_error", last
            message = last["error"]["message"]
        assert "shutting down" in message and "drain timeout" in message

    # the worker dropped the cut replies and still serves
    for _ in range(100):
        health = httpx.get(stack.url + "/health", timeout=10).json()
        if health["worker"]["running"] == 0:
            break
        time.sleep(0.1)
    assert health["worker"]["running"] == 0, health
    reply = httpx.post(stack.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert reply.status_code == 200
