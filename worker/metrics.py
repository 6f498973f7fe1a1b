"""The worker's Prometheus metrics, served on their own port (``--metrics-port``).

The scheduler's state as gauges read at scrape time (requests waiting, streams running, KV slots
holding a cache), each decode step's time and batch size, the KV store's traffic (chunks
restored, written, missed, dropped, and their bytes), a fleet's choices and grammar compile times. One worker is
one process, so the library's default registry holds them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("lmserve.worker")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

WAITING = Gauge("lmserve_worker_waiting_requests", "Requests queued for a place in the batch")
RUNNING = Gauge("lmserve_worker_running_streams", "Streams in the batch")
SLOTS_USED = Gauge("lmserve_worker_kv_slots_used", "Resident KV slots holding a cache")
SLOTS = Gauge("lmserve_worker_kv_slots", "Resident KV slots")
STEP = Histogram("lmserve_worker_step_seconds", "One scheduler step: a forward pass over the batch's new tokens",
                 buckets=STEP_BUCKETS)
BATCH = Histogram("lmserve_worker_batch_streams", "Streams in the forward pass of a step",
                  buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
STEP_TOKENS = Counter("lmserve_worker_step_tokens", "Tokens fed to forward passes, by phase", ["phase"])
KV_CHUNKS = Counter("lmserve_worker_kvstore_chunks", "KV store chunks by event: restored (a hit), missed "
                    "(asked for, not restored: absent or unusable), written (spilled), dropped (the write "
                    "queue was full), rejected (read back forged, altered, moved, oversized, not a regular "
                    "file, or holding values no model writes)", ["event"])
KV_BYTES = Counter("lmserve_worker_kvstore_bytes", "KV bytes moved to and from the KV store", ["direction"])
FLEET_CHOICES = Counter("lmserve_worker_fleet_choices", "A fleet's choices of a conversation's cartridges: new (a "
                        "conversation not seen before), kept (a later turn), switched (--rag-adaptive)", ["how"])
SPEC_TOKENS = Counter("lmserve_worker_speculative_tokens", "Speculative decoding's drafted tokens, and of them "
                     "those accepted (the reply holds them), by what drafted them", ["kind", "event"])
GRAMMAR_COMPILE = Histogram("lmserve_worker_grammar_compile_seconds", "Compiling a request's grammar",
                            buckets=COMPILE_BUCKETS)


def watch_scheduler(waiting: Callable[[], int], running: Callable[[], int], slots_used: Callable[[], int],
                    slots: int) -> None:
    """Gauges that read the scheduler's state when scraped."""
    WAITING.set_function(waiting)
    RUNNING.set_function(running)
    SLOTS_USED.set_function(slots_used)
    SLOTS.set(slots)


def serve(port: int, host: str) -> None:
    """Serve /metrics on host:port from a thread of this process."""
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
