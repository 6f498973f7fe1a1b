"""Prometheus metrics after real traffic: two gateways and the worker are scraped, and their
counts add up to what was sent. Gateways given one multiprocess directory (as ``lmserve serve``
gives its gateways) each report the sum of both."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_tiny_gguf

from gateway.metrics import MULTIPROCESS_ENV


def scrape(url: str, **headers: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a metrics page: (name, sorted labels) -> value."""
    response = httpx.get(url, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(value for (sample, got), value in samples.items()
               if sample == name and all(dict(got).get(k) == v for k, v in labels.items()))


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def metered(tmp_path_factory, start_worker, start_gateway):
    model = tmp_path_factory.mktemp("metrics") / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=1024)
    port = free_port()
    worker = start_worker(model, "--metrics-port", str(port), "--batch", "2", "--kv-slots", "2", "--ctx", "1024")
    return [start_gateway(worker), start_gateway(worker)], f"http://127.0.0.1:{port}/metrics", worker


def test_counts_add_up_across_two_gateways_and_the_worker(metered):
    (first, second), worker_url, _ = metered
    sent: dict[tuple[str, str], int] = {}
    completion_tokens = 0

    def post(gateway, path: str, body: dict, dialect: str, stream: bool = False) -> None:
        nonlocal completion_tokens
        if stream:
            with httpx.stream("POST", gateway.url + path, json={**body, "stream": True}, timeout=60) as response:
                status = response.status_code
                chunks = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: {")]
            usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
        else:
            response = httpx.post(gateway.url + path, json=body, timeout=60)
            status, usage = response.status_code, response.json().get("usage")
        if usage:
            completion_tokens += usage.get("completion_tokens") or usage.get("output_tokens") or 0
        sent[(dialect, str(status))] = sent.get((dialect, str(status)), 0) + 1

    for gateway in (first, second, first):
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": [user("Hi")], "max_tokens": 5}, "chat")
    post(second, "/v1/chat/completions", {"model": "m", "messages": [user("Hi")], "max_tokens": 6,
                                          "stream_options": {"include_usage": True}}, "chat", stream=True)
    post(first, "/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 4}, "responses")
    post(second, "/v1/messages", {"model": "m", "messages": [user("Hi")], "max_tokens": 7}, "anthropic")
    post(first, "/v1/completions", {"model": "m", "prompt": "Once", "max_tokens": 3}, "completions")
    post(second, "/v1/chat/completions", {"model": "m", "messages": [user("Hi")], "max_tokens": 5,
                                          "response_format": {"type": "json_object"}}, "chat")
    post(first, "/v1/chat/completions", {"model": "m", "messages": "not a list"}, "chat")  # a 400
    assert ("chat", "400") in sent

    gateways = [scrape(g.url + "/metrics") for g in (first, second)]
    for (dialect, status), count in sent.items():
        assert sum(total(s, "lmserve_requests_total", dialect=dialect, status=status) for s in gateways) == count
    assert sum(total(s, "lmserve_requests_total") for s in gateways) == sum(sent.values())
    assert sum(total(s, "lmserve_tokens_total", kind="completion") for s in gateways) == completion_tokens
    assert sum(total(s, "lmserve_request_duration_seconds_count") for s in gateways) == sum(sent.values())
    answered = sum(sent.values()) - 1  # the 400 generated nothing
    assert sum(total(s, "lmserve_time_to_first_token_seconds_count") for s in gateways) == answered
    assert sum(total(s, "lmserve_inter_token_seconds_count", dialect="chat") for s in gateways) > 0

    worker = scrape(worker_url)
    assert total(worker, "lmserve_worker_running_streams") == 0
    assert total(worker, "lmserve_worker_waiting_requests") == 0
    assert total(worker, "lmserve_worker_kv_slots") == 2
    assert 1 <= total(worker, "lmserve_worker_kv_slots_used") <= 2
    assert total(worker, "lmserve_worker_step_tokens_total", phase="decode") >= completion_tokens - answered
    assert total(worker, "lmserve_worker_step_seconds_count") == total(worker, "lmserve_worker_batch_streams_count") > 0
    assert total(worker, "lmserve_worker_grammar_compile_seconds_count") >= 1


def test_gateways_sharing_a_directory_each_report_the_sum(metered, start_gateway, tmp_path, monkeypatch):
    worker = metered[2]
    monkeypatch.setenv(MULTIPROCESS_ENV, str(tmp_path))  # the gateways inherit it, as under lmserve serve
    first, second = start_gateway(worker), start_gateway(worker)
    monkeypatch.delenv(MULTIPROCESS_ENV)
    for gateway, tokens in ((first, 3), (second, 4), (second, 5)):
        response = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                              json={"model": "m", "messages": [user("Hi")], "max_tokens": tokens})
        assert response.status_code == 200
    for gateway in (first, second):
        samples = scrape(gateway.url + "/metrics")
        assert total(samples, "lmserve_requests_total", dialect="chat") == 3
        assert total(samples, "lmserve_request_duration_seconds_count") == 3


def test_metrics_need_the_api_key(metered, start_gateway):
    gateway = start_gateway(metered[2], "--api-key", "sesame")
    assert httpx.get(gateway.url + "/metrics", timeout=10).status_code == 401
    assert total(scrape(gateway.url + "/metrics", authorization="Bearer sesame"), "lmserve_requests_total") == 0
