"""A gateway's Prometheus metrics (``GET /metrics``, behind the API key like ``/v1/models``).

Per model request, by dialect (``chat``, ``completions``, ``responses``, ``anthropic``): how many
were answered, by HTTP status and finish reason; the time to the first generated token, the
time between a reply's successive pieces, and the whole request's time; prompt, cached and
completion tokens.

Gateways that share a port (``lmserve serve --gateways N``) are one server to a scraper, which
reaches whichever the kernel picks: ``lmserve serve`` gives them one directory in
``PROMETHEUS_MULTIPROC_DIR``, where each process keeps its numbers, and each answers with the
sum over all of them (the ``prometheus_client`` library's multiprocess mode). A gateway started
alone (its own container or pod) reports its own numbers, and the scraper sums the gateways.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess

from gateway.flags import MULTIPROCESS_ENV

# seconds: from tens of milliseconds (a cached short prompt) to minutes (a long cold prompt)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("lmserve_requests", "Model requests answered, by dialect, HTTP status, finish reason "
                   "(499: the client left first; finish '-': no reply was generated) and API key's name "
                   "(key1, key2, ... for --api-key's keys in order, a keys file's own names; '-': no key)",
                   ["dialect", "status", "finish", "key"])
TOKENS = Counter("lmserve_tokens", "Tokens of model requests by kind: prompt, cached (of the prompt, "
                 "reused rather than computed) and completion", ["dialect", "kind"])
FIRST_TOKEN = Histogram("lmserve_time_to_first_token_seconds", "From a request's arrival to its first "
                        "generated piece", ["dialect"], buckets=LATENCY_BUCKETS)
BETWEEN_TOKENS = Histogram("lmserve_inter_token_seconds", "Between a reply's successive generated pieces "
                           "as the gateway sends them", ["dialect"], buckets=GAP_BUCKETS)
DURATION = Histogram("lmserve_request_duration_seconds", "From a model request's arrival to the end of its "
                     "reply", ["dialect"], buckets=LATENCY_BUCKETS)

ROUTES = Counter("lmserve_routes", "Model requests by the worker they went to and the rule that chose it "
                 "(prefix, hash, load, round-robin; gateway/worker_pool.py)", ["worker", "route"])


def record_request(fields: dict) -> None:
    """Count one finished model request from its access-log fields."""
    dialect = fields["dialect"]
    REQUESTS.labels(dialect, str(fields["status"]), fields["finish"] or "-", fields["key"] or "-").inc()
    DURATION.labels(dialect).observe(fields["total_ms"] / 1000)
    if fields["ttft_ms"] is not None:
        FIRST_TOKEN.labels(dialect).observe(fields["ttft_ms"] / 1000)
    if fields["route"]:
        ROUTES.labels(fields["worker"], fields["route"]).inc()
    for kind in ("prompt", "cached", "completion"):
        if fields[f"{kind}_tokens"]:
            TOKENS.labels(dialect, kind).inc(fields[f"{kind}_tokens"])


def record_gap(dialect: str, seconds: float) -> None:
    BETWEEN_TOKENS.labels(dialect).observe(seconds)


def exposition() -> tuple[bytes, str]:
    """The metrics page: every gateway's sum in multiprocess mode, else this process's own."""
    if os.environ.get(MULTIPROCESS_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
