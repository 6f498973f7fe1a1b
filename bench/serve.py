"""lmserve and llama.cpp's server side by side: the same GGUF, the same requests, one run.

    python -m bench.serve [--repeats 3] [--quick] [--model MODEL.gguf]
    python -m bench.serve --url lmserve=http://127.0.0.1:8080     (drive a running server)

Both servers are started by the harness, one at a time (never together: they would share the
cores), and restarted for every repeat so that each repeat starts cold and the repeats of the two
servers interleave (a burst of load from elsewhere then hits both, not one):

* lmserve: ``lmserve serve MODEL --ctx N --batch 8 --kv-slots 8 --threads T`` from this venv;
* llama.cpp: its C++ ``llama-server``, built with cmake from the llama.cpp tree vendored in the
  ``llama-cpp-python`` sdist (--peer-build; the first of /work/peer-build and .bench-peer/ that
  holds a build, else .bench-peer/ is built, which takes 15-30 minutes on 2 cores), with
  ``-t/-tb`` set to --threads, ``--parallel`` slots as lmserve's --batch, one KV buffer shared by
  the slots (``--kv-unified``) of the same context, and its defaults otherwise (flash attention
  auto, prompt cache on).

Every request streams. Time to first token (TTFT) is measured to the first chunk that carries
content (a bare role chunk does not count); inter-token latency (ITL) is the gap between
content chunks; decode tokens/s per stream is (tokens - 1) / (last chunk - first chunk);
aggregate tokens/s is all streams' tokens over the wall time of the whole batch. Streams that
must have an exact length have every end-of-turn and control token biased away (logit_bias
-100), and the harness checks that each one produced exactly max_tokens.

Scenarios:

1. ``short``: a short prompt + 256 generated tokens, at concurrency 1, 4 and 8;
2. ``long cold``: a fresh 2,000-token prompt (nothing of it cached) + 32 tokens, and
   ``longer cold``: a fresh 6,500-token one (time to first token only);
3. ``next turn``: that conversation's next turn, whose prefix the server may have cached;
4. ``claude-code``: a Claude-Code-shaped session through ``/v1/messages`` (a ~16k-token system
   prompt with tool schemas, a tool round trip, then several turns), on servers that serve
   ``/v1/messages``.

Peak memory is the largest sum of RSS over the server's process tree, sampled every 100 ms.
Every figure is min / median / max over the repeats (each repeat's value is the median over its
streams); the ratio is lmserve's median over llama.cpp's. Results go to
``bench/results/serve.json`` and ``bench/results/serve.png`` (the chart needs matplotlib:
``pip install -e '.[bench]'``). The JSON is rewritten after every server run, so an interrupted
run keeps what it measured; ``--render JSON`` reprints a results file's table and redraws its chart.

On a shared machine other processes skew everything, the two servers differently. Before each
server run and each scenario the harness waits (``--quiet``, ``--quiet-wait``) until the rest of
the machine is nearly idle, and it records the cores other processes used during every scenario
(``other cores per scenario`` in the JSON's checks).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.faults import cpu_flags

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
LMSERVE = "lmserve"
PEER = "llama.cpp"
SERVERS = (LMSERVE, PEER)

PEER_PACKAGE = "llama-cpp-python"
PEER_VERSION = "0.3.36"
# GCC 12 miscompiles llama.cpp's AMX int8 matmul (SIGILL in every prompt evaluation on
# Sapphire Rapids); building without AMX int8 avoids it.
PEER_CMAKE_ARGS = "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
PEER_TARGETS = ("llama-server", "llama-bench", "llama-quantize")
PEER_BUILD_CANDIDATES = (Path("/work/peer-build"), REPO / ".bench-peer")
# llama.cpp's own single-stream decode figures for the default model on 2 cores of a Sapphire
# Rapids machine: its C++ server with the AMX int8 path working (one 256-token stream), and
# llama-bench tg128 without AMX, which is what a build with AMX int8 compiled out compares to.
# A figure far below the second means the peer is misbuilt or starved.
PEER_REFERENCES: dict[str, tuple[float, float]] = {
    "llama.cpp's C++ server, AMX int8 path": (108.0, 142.0),
    "llama-bench tg128 without AMX": (91.0, 97.0),
}
# llama-bench's pp512 / tg128 on 2 cores (tok/s), by the matmul path the CPU and build give
# (../shared/reference/peer-servers.md section 7; the AMX figures are single readings).
KERNEL_REFERENCES: dict[str, dict[str, tuple[float, float]]] = {
    "AMX int8": {"pp512": (1150.0, 1150.0), "tg128": (220.0, 220.0)},
    "without AMX": {"pp512": (200.0, 250.0), "tg128": (91.0, 97.0)},
}
KERNEL_TOLERANCE = 0.15  # "within noise": a shared 2-core machine moves these by about this much
LOWER, HIGHER = "lower", "higher"


# --- statistics and the table (pure) -------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; values must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"min": self.min, "median": self.median, "max": self.max, "n": self.n}


def spread(values: Iterable[float | None]) -> Spread | None:
    """min / median / max of the values that are present; None if there are none."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return Spread(min(present), statistics.median(present), max(present), len(present))


def ratio(ours: Spread | None, theirs: Spread | None) -> float | None:
    """lmserve's median over the peer's, when both exist and the peer's is not zero."""
    if ours is None or theirs is None or theirs.median == 0:
        return None
    return ours.median / theirs.median


@dataclass
class Row:
    """One figure of the table: its per-repeat values for every server."""
    scenario: str
    metric: str
    unit: str
    better: str  # LOWER or HIGHER
    values: dict[str, list[float]] = field(default_factory=dict)
    note: dict[str, str] = field(default_factory=dict)  # per server: why a figure is missing

    @property
    def label(self) -> str:
        return f"{self.scenario}: {self.metric} ({self.unit})"

    def spread(self, server: str) -> Spread | None:
        return spread(self.values.get(server, []))

    def ratio(self) -> float | None:
        return ratio(self.spread(LMSERVE), self.spread(PEER))


def _number(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_cell(s: Spread | None, note: str = "") -> str:
    """``median (min-max)``, or the note (or ``n/a``) when the figure is missing."""
    if s is None:
        return note or "n/a"
    if s.n == 1 or s.min == s.max:
        return _number(s.median)
    return f"{_number(s.median)} ({_number(s.min)}-{_number(s.max)})"


def format_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def table_rows(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> list[list[str]]:
    """Header and body cells; the ratio column only when both servers are in the table."""
    both = LMSERVE in servers and PEER in servers
    header = ["figure", *(f"{s} median (min-max)" for s in servers), *([f"ratio {LMSERVE}/{PEER}"] if both else []),
              "better"]
    body = [[row.label, *(format_cell(row.spread(s), row.note.get(s, "")) for s in servers),
             *([format_ratio(row.ratio())] if both else []), row.better] for row in rows]
    return [header, *body]


def format_text_table(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> str:
    """A fixed-width table for the terminal."""
    cells = table_rows(rows, servers)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown_table(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> str:
    """The same table in Markdown (for the README)."""
    cells = table_rows(rows, servers)
    rule = "|" + "|".join(["---"] + ["---:"] * (len(cells[0]) - 2) + ["---"]) + "|"
    lines = ["| " + " | ".join(cells[0]) + " |", rule]
    lines += ["| " + " | ".join(line) + " |" for line in cells[1:]]
    return "\n".join(lines)


def results_json(rows: Sequence[Row], meta: dict[str, Any], servers: Sequence[str] = SERVERS) -> dict[str, Any]:
    """The JSON document written to bench/results/serve.json."""
    out_rows = []
    for row in rows:
        per_server: dict[str, Any] = {}
        for s in servers:
            sp = row.spread(s)
            per_server[s] = {"values": list(row.values.get(s, [])), **(sp.as_dict() if sp else {}),
                             **({"note": row.note[s]} if s in row.note else {})}
        out_rows.append({"scenario": row.scenario, "metric": row.metric, "unit": row.unit, "better": row.better,
                         "servers": per_server, "ratio": row.ratio()})
    return {"format": 1, "meta": meta, "servers": list(servers), "rows": out_rows,
            "markdown": format_markdown_table(rows, servers)}


# --- streaming clients ---------------------------------------------------------------------

@dataclass
class StreamResult:
    started: float  # perf_counter at request start
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    ended: float = 0.0
    tokens: int | None = None  # completion tokens as the server reported them
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.started if self.chunk_times else None

    def output_tokens(self, max_tokens: int | None = None) -> int:
        """Reported usage; else max_tokens when the stream ended on length; else content chunks."""
        if self.tokens is not None:
            return self.tokens
        if max_tokens is not None and self.finish_reason in ("length", "max_tokens"):
            return max_tokens
        return len(self.chunk_times)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def decode_rate(self, max_tokens: int | None = None) -> float | None:
        n = self.output_tokens(max_tokens)
        if len(self.chunk_times) < 2 or n < 2:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (n - 1) / span if span > 0 else None


class SseParser:
    """Server-sent events, one line at a time: ``feed`` returns (event name, data) when one ends."""

    def __init__(self) -> None:
        self.event: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str | None, str] | None:
        line = line.rstrip("\r")
        if line == "":
            if not self.data:
                self.event = None
                return None
            done = (self.event, "\n".join(self.data))
            self.event, self.data = None, []
            return done
        if line.startswith(":"):
            return None  # a comment: keep-alive pings
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].lstrip(" "))
        return None

    def close(self) -> tuple[str | None, str] | None:
        return self.feed("")


def apply_chat_chunk(result: StreamResult, payload: dict[str, Any], now: float) -> None:
    """Fold one Chat Completions stream chunk into the result."""
    if payload.get("error"):
        raise RuntimeError(f"stream error: {payload['error']}")
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        # a chat chunk's delta, or a text completion's text
        text = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
        if text or delta.get("tool_calls"):
            result.chunk_times.append(now)
            result.text += text
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if usage:
        result.tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def apply_messages_event(result: StreamResult, event: str | None, payload: dict[str, Any], now: float) -> None:
    """Fold one Anthropic Messages stream event into the result."""
    kind = payload.get("type", event)
    if kind == "error":
        raise RuntimeError(f"stream error: {payload.get('error')}")
    if kind == "message_start":
        usage = (payload.get("message") or {}).get("usage") or {}
        result.cached_tokens = usage.get("cache_read_input_tokens")
        if usage.get("input_tokens") is not None:
            result.prompt_tokens = usage["input_tokens"] + (result.cached_tokens or 0)
    elif kind == "content_block_delta":
        delta = payload.get("delta") or {}
        text = delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
        if text:
            result.chunk_times.append(now)
            result.text += delta.get("text") or ""
    elif kind == "message_delta":
        result.finish_reason = (payload.get("delta") or {}).get("stop_reason")
        usage = payload.get("usage") or {}
        if usage.get("output_tokens") is not None:
            result.tokens = usage["output_tokens"]
        if usage.get("cache_read_input_tokens") is not None:
            result.cached_tokens = usage["cache_read_input_tokens"]


async def stream_request(client: Any, base_url: str, path: str, body: dict[str, Any]) -> StreamResult:
    """POST one streaming request and time its chunks (path /v1/chat/completions or /v1/messages)."""
    messages_api = path.endswith("/messages")
    headers = {"x-api-key": "bench", "anthropic-version": "2023-06-01"} if messages_api else {}
    result = StreamResult(started=time.perf_counter())
    parser = SseParser()

    def handle(event: tuple[str | None, str] | None, now: float) -> bool:
        if event is None:
            return False
        name, data = event
        if data.strip() == "[DONE]":
            return True
        payload = json.loads(data)
        if messages_api:
            apply_messages_event(result, name, payload, now)
        else:
            apply_chat_chunk(result, payload, now)
        return False

    async with client.stream("POST", base_url.rstrip("/") + path, json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode("utf-8", "replace")[:500]
            raise RuntimeError(f"{path} answered {response.status_code}: {detail}")
        done = False
        async for line in response.aiter_lines():
            if handle(parser.feed(line), time.perf_counter()):
                done = True
                break
        if not done:
            handle(parser.close(), time.perf_counter())
    result.ended = time.perf_counter()
    return result


async def run_batch(client: Any, base_url: str, path: str,
                    bodies: Sequence[dict[str, Any]]) -> tuple[list[StreamResult], float]:
    """Start all requests at once; return their results and the batch's wall time."""
    started = time.perf_counter()
    results = await asyncio.gather(*(stream_request(client, base_url, path, b) for b in bodies))
    return list(results), time.perf_counter() - started


# --- workloads (synthetic text, deterministic per seed) ------------------------------------

_SUBJECTS = ("the scheduler", "every gateway", "the cache layer", "a background job", "the parser",
             "our billing service", "the storage node", "each worker", "the retry loop", "the config loader",
             "the test runner", "a client library", "the index builder", "the metrics exporter")
_VERBS = ("reads", "rewrites", "validates", "forwards", "compresses", "batches", "logs", "retries",
          "serializes", "checks", "merges", "splits", "records", "rejects")
_OBJECTS = ("incoming requests", "the pending queue", "stale entries", "user settings", "partial uploads",
            "the audit trail", "large payloads", "expired tokens", "the nightly report", "shard boundaries",
            "duplicate events", "the schema version", "open connections", "rate limits")
_TAILS = ("before it answers", "once per minute", "when the disk is full", "under heavy load",
          "after a restart", "only in production", "for every tenant", "without holding a lock",
          "in a single pass", "when a deadline passes", "as soon as possible", "in the order they arrived")
_TOPICS = ("a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a lost violin",
           "a detective who is a cat", "a glacier that remembers", "a clockmaker's apprentice",
           "a library that never closes", "two rival bakers", "a map with one missing island")


def prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append(s[0].upper() + s[1:] + ".")
    return " ".join(out)


def sized_text(count: Callable[[str], int], target: int, seed: int, head: str = "") -> str:
    """``head`` followed by prose, as close to ``target`` tokens as whole sentences allow."""
    rng = random.Random(seed)
    text = head
    while count(text) < target:
        text = (text + " " if text else "") + prose(rng, max(1, (target - count(text)) // 14))
    while count(text) > target and ". " in text:
        text = text[:text.rstrip(".").rfind(". ") + 1]
    return text


def short_prompts(n: int) -> list[str]:
    return [f"Write a long story about {_TOPICS[i % len(_TOPICS)]}." for i in range(n)]


def tool_schemas(rng: random.Random, count: Callable[[str], int], target: int) -> list[dict[str, Any]]:
    """Tool definitions in Anthropic's shape, about ``target`` tokens as JSON."""
    names = ("read_file", "write_file", "edit_file", "list_directory", "search_text", "run_command",
             "fetch_url", "todo_update", "spawn_agent", "notebook_edit", "glob_files", "ask_user",
             "git_status", "open_browser", "run_tests", "format_code", "lint_code", "deploy_preview")
    tools: list[dict[str, Any]] = []
    i = 0
    while count(json.dumps(tools)) < target:
        name = names[i % len(names)] + ("" if i < len(names) else f"_{i // len(names)}")
        props = {f"arg_{k}": {"type": rng.choice(("string", "integer", "boolean")),
                              "description": prose(rng, 2)} for k in range(rng.randint(2, 5))}
        tools.append({"name": name, "description": prose(rng, 12),
                      "input_schema": {"type": "object", "properties": props, "required": list(props)[:1],
                                       "additionalProperties": False}})
        i += 1
    return tools


def claude_code_system(count: Callable[[str], int], target: int, seed: int,
                       session: str = "") -> tuple[str, list[dict[str, Any]]]:
    """A long system prompt: instructions plus the tool schemas written out; and a few tools."""
    rng = random.Random(seed)
    schemas = tool_schemas(rng, count, target * 3 // 5)
    reference = "\n".join(f"## {t['name']}\n{json.dumps(t, indent=1)}" for t in schemas)
    rest = max(0, target - count(reference) - 40)
    rules = sized_text(count, rest, seed + 1, f"Session {session}. You are a coding agent working in the "
                                              "user's repository.")
    system = f"{rules}\n\n# Tools\nThe tools below are available; call them by name.\n{reference}"
    return system, schemas[:4]


# --- the servers ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_peer_build(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    for candidate in PEER_BUILD_CANDIDATES:
        if (candidate / "bin" / "llama-server").exists():
            return candidate
    return PEER_BUILD_CANDIDATES[-1]


def ensure_peer(build: Path) -> Path:
    """The directory of the peer's binaries (llama-server, llama-bench, llama-quantize), built
    into ``build`` from the llama.cpp tree of the llama-cpp-python sdist if they are missing."""
    binaries = build / "bin"
    if all((binaries / target).exists() for target in PEER_TARGETS):
        return binaries
    print(f"bench.serve: building {', '.join(PEER_TARGETS)} from the llama.cpp tree of {PEER_PACKAGE} "
          f"{PEER_VERSION} into {build} ({PEER_CMAKE_ARGS}); this takes 15-30 minutes on 2 cores",
          file=sys.stderr)
    import tarfile
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", scratch, f"{PEER_PACKAGE}=={PEER_VERSION}"], check=True)
        (sdist,) = Path(scratch).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(scratch, filter="data")
        (source,) = Path(scratch).glob("*/vendor/llama.cpp")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", *PEER_CMAKE_ARGS.split()], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                        "--target", *PEER_TARGETS], check=True)
    return binaries


@functools.cache
def peer_version(binaries: Path) -> str:
    out = subprocess.run([str(binaries / "llama-server"), "--version"], capture_output=True, text=True, check=False)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


@dataclass
class ServerSpec:
    name: str
    command: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def lmserve_spec(model: str, ctx: int, parallel: int, threads: int, kv_slots: int | None = None,
                 kernel_cache: str | None = None) -> ServerSpec:
    """``lmserve serve`` with --batch ``parallel`` (and --kv-slots its default, unless given);
    ``kernel_cache``: numba's cache directory for the run (an empty one: a first start)."""
    port = free_port()
    env = {k: str(threads) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if kernel_cache:
        env["NUMBA_CACHE_DIR"] = kernel_cache
    slots = ["--kv-slots", str(kv_slots)] if kv_slots else []
    return ServerSpec(LMSERVE, [sys.executable, "-m", "launcher.cli", "serve", model, "--ctx", str(ctx),
                                "--batch", str(parallel), *slots, "--threads", str(threads), "--port", str(port)],
                      port, "/health", env)


def peer_spec(binaries: Path, model: str, ctx: int, parallel: int, threads: int) -> ServerSpec:
    port = free_port()
    return ServerSpec(PEER, [str(binaries / "llama-server"), "-m", model, "-c", str(ctx), "--parallel", str(parallel),
                             "--kv-unified", "-t", str(threads), "-tb", str(threads),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/health")


class MemorySampler:
    """Samples the RSS sum of a process tree, and the CPU the rest of the machine uses meanwhile."""

    def __init__(self, pid: int | None, interval: float = 0.1):
        import psutil
        self._psutil = psutil
        self.pid = pid
        self.interval = interval
        self.peak = 0  # the largest sum of RSS over the process tree
        self.peak_pss = 0  # of PSS: each shared page counted once, split between its processes
        self.roles: dict[str, int] = {}  # each kind of process's largest PSS
        self._server_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0
        self._busy0 = 0.0
        self._self0 = 0.0
        self._server_cpu0: dict[int, float] = {}

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def _sample(self) -> None:
        if self.pid is None:
            return
        try:
            root = self._psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except self._psutil.Error:
            return
        rss = pss = 0
        for p in procs:
            try:
                mine = process_memory(p.pid) or (p.memory_info().rss, p.memory_info().rss)
                rss += mine[0]
                pss += mine[1]
                role = process_role(p.cmdline())
                self.roles[role] = max(self.roles.get(role, 0), mine[1])
                times = p.cpu_times()
                self._server_cpu[p.pid] = times.user + times.system
            except self._psutil.Error:
                pass
        self.peak = max(self.peak, rss)
        self.peak_pss = max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def reset_peak(self) -> None:
        self.peak = self.peak_pss = 0
        self._sample()

    def start(self) -> MemorySampler:
        self._started = time.perf_counter()
        self._busy0 = self._busy()
        me = self._psutil.Process().cpu_times()
        self._self0 = me.user + me.system
        self._sample()
        self._server_cpu0 = dict(self._server_cpu)
        self._thread.start()
        return self

    def mark(self) -> tuple[float, float, float, float]:
        """A reading to measure the other processes' CPU use from (see ``other_cores``)."""
        me = self._psutil.Process().cpu_times()
        return time.perf_counter(), self._busy(), sum(self._server_cpu.values()), me.user + me.system

    def other_cores(self, since: tuple[float, float, float, float]) -> float | None:
        """Cores used on average by processes other than the server and this harness since ``since``."""
        if self.pid is None:
            return None
        self._sample()
        now = self.mark()
        wall = max(now[0] - since[0], 1e-9)
        return max(0.0, ((now[1] - since[1]) - (now[2] - since[2]) - (now[3] - since[3])) / wall)

    def stop(self) -> dict[str, float]:
        """Stop sampling; return the other processes' average CPU use (in cores) and the load average."""
        self._stop.set()
        self._thread.join()
        wall = max(time.perf_counter() - self._started, 1e-9)
        me = self._psutil.Process().cpu_times()
        server = sum(self._server_cpu.values()) - sum(self._server_cpu0.values())
        other = self._busy() - self._busy0 - server - (me.user + me.system - self._self0)
        if self.pid is None:  # a server we did not start: its CPU cannot be told apart
            return {"loadavg_1m": os.getloadavg()[0]}
        return {"other_cores": max(0.0, other / wall), "server_cores": server / wall,
                "loadavg_1m": os.getloadavg()[0]}


def process_memory(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of a process in bytes, from /proc (None where it cannot be read). PSS splits
    each page among the processes that map it: summed over a stack of processes sharing
    libraries, it is the memory the stack holds; RSS sums count shared pages once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.split()[1:2]
                      and line.split()[1].isdigit()}
        return fields["Rss"], fields["Pss"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def process_role(cmdline: list[str]) -> str:
    """Which part of a server a process is: lmserve's worker, gateway or launcher, or the peer."""
    words = " ".join(cmdline)
    for role in ("worker", "gateway", "compile_ahead"):
        if f" {role}" in words or words.endswith(role):
            return role
    return "launcher" if "launcher" in words else os.path.basename(cmdline[0]) if cmdline else "?"


def wait_for_quiet(threshold: float, max_wait: float, probe: float = 5.0) -> float:
    """Wait until the machine's other processes use at most ``threshold`` cores (or max_wait
    seconds pass); return the last reading. Run between servers, so nothing of ours is busy."""
    import psutil
    waited = 0.0
    while True:
        busy = psutil.cpu_percent(interval=probe) / 100.0 * (os.cpu_count() or 1)
        if busy <= threshold or waited >= max_wait:
            if busy > threshold:
                print(f"bench.serve:   the machine is still busy ({busy:.2f} cores used by others) after "
                      f"{waited:.0f} s; measuring anyway", flush=True)
            return busy
        if waited == 0:
            print(f"bench.serve:   other processes use {busy:.2f} cores; waiting up to {max_wait:.0f} s for "
                  "a quieter machine", flush=True)
        time.sleep(10)
        waited += 10 + probe


def start_server(spec: ServerSpec, log: Path, timeout: float = 600.0) -> subprocess.Popen:
    """Start a server and wait until it answers ready; ``proc.ready_after`` is how long that
    took (seconds, to a tenth)."""
    import httpx
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(spec.command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **spec.env}, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} while starting; "
                               f"log {log}:\n{_tail(log)}")
        try:
            if httpx.get(spec.base_url + spec.ready_path, timeout=2).status_code == 200:
                proc.ready_after = time.monotonic() - started  # type: ignore[attr-defined]
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"{spec.name} not ready after {timeout:.0f} s; log {log}:\n{_tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


async def serves_messages(client: Any, base_url: str, model: str) -> bool:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post(base_url + "/v1/messages", json=body,
                                 headers={"x-api-key": "bench", "anthropic-version": "2023-06-01"})
    return response.status_code == 200


# --- one server, one repeat ----------------------------------------------------------------

@dataclass
class Plan:
    short_tokens: int
    concurrency: tuple[int, ...]
    long_prompt: int
    long_tokens: int
    longer_prompt: int
    cc_system: int
    cc_turns: int
    cc_tokens: int
    longest_prompt: int = 0  # a cold prompt of this many tokens, where the model's context holds it (0: none)
    claude_code: bool = True


FULL = Plan(short_tokens=256, concurrency=(1, 4, 8), long_prompt=2000, long_tokens=32, longer_prompt=6500,
            cc_system=16000, cc_turns=4, cc_tokens=64)
QUICK = Plan(short_tokens=32, concurrency=(1, 4, 8), long_prompt=500, long_tokens=16, longer_prompt=1500,
             cc_system=3000, cc_turns=2, cc_tokens=16)


class Workload:
    """Requests shared by every server, sized with the model's own tokenizer."""

    def __init__(self, model_path: str, plan: Plan, nonce: int = 0):
        from shared.chat_template import chat_template_from_metadata
        from shared.tokenizer import Tokenizer
        from worker.engine.gguf_file import GGUFFile
        meta = GGUFFile(model_path).metadata
        self.context = int(meta.get(f"{meta.get('general.architecture')}.context_length", 0) or 0)
        self.tokenizer = Tokenizer.from_gguf_metadata(meta)
        self.template = chat_template_from_metadata(meta)
        self.plan = plan
        # base models (no chat template) are driven through the text completions endpoint
        self.path = "/v1/chat/completions" if self.template is not None else "/v1/completions"
        self.nonce = nonce  # starts every long prompt, so nothing of it is cached from an earlier run
        self.no_stop = {str(i): -100 for i in sorted(self.tokenizer.stop_ids | self.tokenizer.special_ids)}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special=False, parse_special=False))

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> int | None:
        """The prompt's length as the model's own template (or the plain text a base model
        gets) and tokenizer make it."""
        if self.template is None:
            return len(self.tokenizer.encode(self.plain(messages), add_special=True))
        return len(self.tokenizer.encode(self.template.render(messages), add_special=True))

    @staticmethod
    def plain(messages: list[dict[str, Any]]) -> str:
        """A conversation as the plain text a base model continues."""
        return "\n\n".join(str(m["content"]) for m in messages) + "\n\n"

    def chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int, exact: bool = True) -> dict[str, Any]:
        """A streaming request of the conversation: a chat completion, or a text completion of
        its plain text for a base model (``path`` says which)."""
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.template is None:
            body["prompt"] = self.plain(messages)
        else:
            body["messages"] = messages
        if exact:
            body["logit_bias"] = self.no_stop
        return body

    def long_conversation(self, seed: int, tokens: int | None = None) -> list[dict[str, Any]]:
        head = f"Session {self.nonce}-{seed}: summarise the operations notes below in three bullet points."
        size = (tokens or self.plan.long_prompt) - 20
        return [{"role": "user", "content": sized_text(self.count, size, seed, head)}]

    def claude_code(self, seed: int) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        system, tools = claude_code_system(self.count, self.plan.cc_system, seed, f"{self.nonce}-{seed}")
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Find where the retry loop handles expired tokens and explain it."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "I will look at the file first."},
                {"type": "tool_use", "id": "toolu_bench_1", "name": tools[0]["name"],
                 "input": {"arg_0": "src/retry.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_bench_1",
                 "content": sized_text(self.count, 400, seed + 7, "src/retry.py:")}]},
        ]
        return system, tools, messages


@dataclass
class RepeatFigures:
    values: dict[str, float | None] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


async def served_model(client: Any, base_url: str) -> str:
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_server_repeat(base_url: str, work: Workload, repeat: int, sampler: MemorySampler | None,
                            quiet: float = -1.0, quiet_wait: float = 0.0) -> RepeatFigures:
    """Every scenario once against one server. With a sampler and ``quiet`` >= 0, each scenario
    first waits (up to quiet_wait s) until other processes use at most ``quiet`` cores."""
    import httpx
    plan = work.plan
    figs = RepeatFigures()
    chat_path = work.path
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        model = await served_model(client, base_url)
        # warm-up: first-request costs (imports, allocations) are not part of any figure
        await run_batch(client, base_url, chat_path, [work.chat(model, [{"role": "user", "content": "Hello"}], 4)])
        prompts = short_prompts(max(plan.concurrency))
        others: dict[str, float | None] = {}
        figs.checks["other cores per scenario"] = others
        mark = sampler.mark() if sampler else None

        async def settle() -> None:
            nonlocal mark
            if sampler is None or sampler.pid is None or quiet < 0:
                return
            waited = 0.0
            while True:
                probe = sampler.mark()
                await asyncio.sleep(3.0)
                busy = sampler.other_cores(probe) or 0.0
                if busy <= quiet or waited >= quiet_wait:
                    break
                waited += 3.0
            mark = sampler.mark()

        def note_load(scenario: str) -> None:
            if sampler is not None and mark is not None:
                value = sampler.other_cores(mark)
                others[scenario] = None if value is None else round(value, 2)

        for c in plan.concurrency:
            await settle()
            bodies = [work.chat(model, [{"role": "user", "content": p}], plan.short_tokens) for p in prompts[:c]]
            results, wall = await run_batch(client, base_url, chat_path, bodies)
            n = plan.short_tokens
            tokens = [r.output_tokens(n) for r in results]
            gaps = [g for r in results for g in r.gaps()]
            key = f"short c={c}"
            figs.values[f"{key}|ttft"] = _ms(_median(r.ttft for r in results))
            figs.values[f"{key}|itl"] = _ms(statistics.median(gaps)) if gaps else None
            figs.values[f"{key}|itl_p95"] = _ms(percentile(gaps, 95)) if gaps else None
            figs.values[f"{key}|decode"] = _median(r.decode_rate(n) for r in results)
            figs.values[f"{key}|aggregate"] = sum(tokens) / wall
            figs.checks[f"{key} exact length"] = all(t == n and r.finish_reason == "length"
                                                     for t, r in zip(tokens, results))
            figs.checks[f"{key} tokens"] = tokens
            figs.checks[f"{key} usage reported"] = all(r.tokens is not None for r in results)
            note_load(key)
        # long prompt, cold, then the same conversation's next turn
        conversation = work.long_conversation(10_000 * (repeat + 1) + 17)
        await settle()
        (cold,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, conversation, plan.long_tokens)])
        prompt_tokens = work.prompt_tokens(conversation)
        figs.values["long cold|ttft"] = _ms(cold.ttft)
        figs.values["long cold|prefill"] = prompt_tokens / cold.ttft if prompt_tokens and cold.ttft else None
        figs.values["long cold|decode"] = cold.decode_rate(plan.long_tokens)
        figs.checks["long cold prompt tokens"] = {"counted": prompt_tokens, "reported": cold.prompt_tokens}
        note_load("long cold")
        conversation += [{"role": "assistant", "content": cold.text},
                         {"role": "user", "content": "Now list the two riskiest items and say why."}]
        await settle()
        (nxt,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, conversation, plan.long_tokens)])
        figs.values["next turn|ttft"] = _ms(nxt.ttft)
        figs.values["next turn|decode"] = nxt.decode_rate(plan.long_tokens)
        figs.checks["next turn prompt tokens"] = {"counted": work.prompt_tokens(conversation),
                                                  "reported": nxt.prompt_tokens}
        figs.checks["next turn cached tokens"] = nxt.cached_tokens
        note_load("next turn")
        if plan.longer_prompt:
            longer = work.long_conversation(10_000 * (repeat + 1) + 29, plan.longer_prompt)
            await settle()
            (far,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, longer, 4)])
            longer_tokens = work.prompt_tokens(longer)
            figs.values["longer cold|ttft"] = _ms(far.ttft)
            figs.values["longer cold|prefill"] = longer_tokens / far.ttft if longer_tokens and far.ttft else None
            figs.checks["longer cold prompt tokens"] = {"counted": longer_tokens, "reported": far.prompt_tokens}
            note_load("longer cold")
        if plan.longest_prompt and work.context >= plan.longest_prompt + 64:
            longest = work.long_conversation(10_000 * (repeat + 1) + 31, plan.longest_prompt)
            await settle()
            (cold16,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, longest, 4)])
            longest_tokens = work.prompt_tokens(longest)
            figs.values["longest cold|ttft"] = _ms(cold16.ttft)
            figs.values["longest cold|prefill"] = (longest_tokens / cold16.ttft if longest_tokens and cold16.ttft
                                                   else None)
            figs.checks["longest cold prompt tokens"] = {"counted": longest_tokens, "reported": cold16.prompt_tokens}
            note_load("longest cold")
        if sampler is not None:
            figs.values["memory|chat"] = sampler.peak / 2**20
            figs.values["memory|pss"] = sampler.peak_pss / 2**20
            figs.checks["peak PSS by process (MiB)"] = {k: round(v / 2**20, 1) for k, v in sampler.roles.items()}
        # a Claude-Code-shaped session through /v1/messages
        if not plan.claude_code:
            figs.checks["claude-code"] = "skipped (--no-claude-code)"
        elif await serves_messages(client, base_url, model):
            system, tools, messages = work.claude_code(repeat)
            await settle()
            ttfts, rates, cached = [], [], []
            try:
                for turn in range(plan.cc_turns):
                    body = {"model": model, "max_tokens": plan.cc_tokens, "stream": True, "temperature": 0,
                            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                            "tools": tools, "messages": messages}
                    (r,), _ = await run_batch(client, base_url, "/v1/messages", [body])
                    ttfts.append(r.ttft)
                    rates.append(r.decode_rate())
                    cached.append(r.cached_tokens)
                    if turn == 0:
                        figs.checks["claude-code prompt tokens"] = r.prompt_tokens
                    messages = messages + [{"role": "assistant", "content": r.text or "(no text)"},
                                           {"role": "user", "content": prose(random.Random(turn), 4)}]
            except httpx.HTTPError as exc:  # a server that dies mid-session fails this scenario only
                figs.checks["claude-code"] = f"failed at turn {len(ttfts) + 1}: {type(exc).__name__}: {exc}"
                return figs
            figs.values["claude-code|ttft first"] = _ms(ttfts[0])
            figs.values["claude-code|ttft later"] = _ms(_median(ttfts[1:]))
            figs.values["claude-code|decode"] = _median(rates)
            figs.checks["claude-code cached tokens per turn"] = cached
            figs.checks["claude-code ttft per turn (ms)"] = [_ms(t) for t in ttfts]
            note_load("claude-code")
            if sampler is not None:
                figs.values["memory|all"] = sampler.peak / 2**20
        else:
            figs.checks["claude-code"] = "skipped: no /v1/messages"
    return figs


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


ROW_SPECS: tuple[tuple[str, str, str, str], ...] = (
    ("ttft", "time to first token", "ms", LOWER),
    ("itl", "inter-token latency, median", "ms", LOWER),
    ("itl_p95", "inter-token latency, p95", "ms", LOWER),
    ("decode", "decode per stream", "tok/s", HIGHER),
    ("aggregate", "aggregate", "tok/s", HIGHER),
)
OTHER_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("long cold|ttft", "time to first token", "ms", LOWER),
    ("long cold|prefill", "prefill", "tok/s", HIGHER),
    ("long cold|decode", "decode at that context", "tok/s", HIGHER),
    ("longer cold|ttft", "time to first token", "ms", LOWER),
    ("longer cold|prefill", "prefill", "tok/s", HIGHER),
    ("longest cold|ttft", "time to first token", "ms", LOWER),
    ("longest cold|prefill", "prefill", "tok/s", HIGHER),
    ("next turn|ttft", "time to first token", "ms", LOWER),
    ("next turn|decode", "decode", "tok/s", HIGHER),
    ("claude-code|ttft first", "time to first token, turn 1 (cold)", "ms", LOWER),
    ("claude-code|ttft later", "time to first token, later turns", "ms", LOWER),
    ("claude-code|decode", "decode", "tok/s", HIGHER),
    ("memory|chat", "peak RSS, chat scenarios", "MiB", LOWER),
    ("memory|pss", "peak PSS, chat scenarios", "MiB", LOWER),
    ("memory|all", "peak RSS, with claude-code", "MiB", LOWER),
    ("start|cold", "start to ready, empty kernel cache", "s", LOWER),
    ("start|warm", "start to ready", "s", LOWER),
)


def scenario_titles(plan: Plan) -> dict[str, str]:
    return {"long cold": f"{plan.long_prompt}-token prompt, cold",
            "longer cold": f"{plan.longer_prompt}-token prompt, cold", "next turn": "next turn (prefix cached)",
            "longest cold": f"{plan.longest_prompt}-token prompt, cold",
            "claude-code": f"claude-code /v1/messages (~{plan.cc_system // 1000}k system)", "memory": "server",
            "start": "server"}


def build_rows(plan: Plan, per_server: dict[str, list[RepeatFigures]], notes: dict[str, dict[str, str]]) -> list[Row]:
    """Turn each server's per-repeat figures into table rows (pure)."""
    titles = scenario_titles(plan)
    keys: list[tuple[str, str, str, str, str]] = []
    for c in plan.concurrency:
        for metric, label, unit, better in ROW_SPECS:
            keys.append((f"short c={c}|{metric}", f"short+{plan.short_tokens}, {c} stream{'s' * (c > 1)}",
                         label, unit, better))
    for key, label, unit, better in OTHER_ROWS:
        keys.append((key, titles[key.split("|")[0]], label, unit, better))
    rows = []
    for key, scenario, label, unit, better in keys:
        row = Row(scenario, label, unit, better)
        for server, repeats in per_server.items():
            row.values[server] = [v for v in (r.values.get(key) for r in repeats) if v is not None]
            note = notes.get(server, {}).get(key.split("|")[0])
            if note and not row.values[server]:
                row.note[server] = note
        if any(row.values.values()):
            rows.append(row)
    return rows


# --- the chart -----------------------------------------------------------------------------

def write_chart(rows: Sequence[Row], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.serve: matplotlib is missing, so no chart; install it with "
              "`pip install -e '.[bench]'`", file=sys.stderr)
        return False
    groups = [g for g in (("tok/s", "tokens/s (higher is better)", False, 3),
                          ("ms", "milliseconds (lower is better, log)", True, 3),
                          ("MiB", "peak RSS, MiB (lower is better)", False, 1.6))
              if any(r.unit == g[0] for r in rows)]
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 9), squeeze=False,
                             gridspec_kw={"width_ratios": [g[3] for g in groups]})
    axes = axes[0]
    colors = {LMSERVE: "#3366cc", PEER: "#dd7733"}
    for ax, (unit, heading, log, _) in zip(axes, groups):
        chosen = [r for r in rows if r.unit == unit]
        labels = [f"{r.scenario}\n{r.metric}" for r in chosen]
        height = 0.38
        for k, server in enumerate(SERVERS):
            ys, xs, lo, hi = [], [], [], []
            for i, r in enumerate(chosen):
                s = r.spread(server)
                if s is None:
                    continue
                ys.append(i + (k - 0.5) * height)
                xs.append(s.median)
                lo.append(s.median - s.min)
                hi.append(s.max - s.median)
            ax.barh(ys, xs, height, xerr=[lo, hi], color=colors[server], label=server, capsize=2)
        ax.set_yticks(range(len(chosen)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(heading, fontsize=10)
        if log:
            ax.set_xscale("log")
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- main ----------------------------------------------------------------------------------

def _git_revision() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the default model)")
    p.add_argument("--models", help="several, one after another, each with its own results and a summary across "
                                    "them: paths, names `lmserve models` knows, or SHAPE:TYPE for a file of a real "
                                    "model's shapes bench.synthetic writes (e.g. qwen3-0.6b:Q8_0)")
    p.add_argument("--concurrency", help="stream counts of the short scenario (default 1,4,8)")
    p.add_argument("--longest", type=int, default=0, metavar="TOKENS",
                   help="also a cold prompt of this many tokens, where the model's context holds it (0: none)")
    p.add_argument("--longer", type=int, default=None, metavar="TOKENS",
                   help="tokens of the second cold prompt (default 6500; 1500 quick; 0: none)")
    p.add_argument("--no-claude-code", action="store_true", help="skip the claude-code session")
    p.add_argument("--kv-slots", type=int, default=None, help="lmserve --kv-slots (default: lmserve's own)")
    p.add_argument("--floor", metavar="MODEL",
                   help="also both servers at their smallest setting (--ctx 4096 and one slot) on this model: "
                        "peak memory")
    p.add_argument("--repeats", type=int, default=None, help="runs of every server (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, fewer tokens, shorter prompts")
    p.add_argument("--ctx", type=int, default=20480, help="context of both servers (default 20480)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of both servers (default 2)")
    p.add_argument("--parallel", type=int, default=8, help="lmserve --batch and --kv-slots (default 8)")
    p.add_argument("--servers", default=",".join(SERVERS), help="which to start (default: both)")
    p.add_argument("--peer-build", help="cmake build directory of llama.cpp whose bin/ holds llama-server and "
                                        "llama-bench (default: /work/peer-build if it has them, else .bench-peer/, "
                                        "built if missing)")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="drive an already running server instead of starting it (no memory figures)")
    p.add_argument("--quiet", type=float, default=0.5, metavar="CORES",
                   help="before each server run, wait until other processes use at most this many cores "
                        "(default 0.5; a negative value never waits)")
    p.add_argument("--quiet-wait", type=float, default=300, metavar="S",
                   help="longest wait for that (and before each scenario), in seconds (default 300)")
    p.add_argument("--cc-system", type=int, help="claude-code system prompt tokens (default 16000; 3000 quick)")
    p.add_argument("--render", metavar="JSON", help="only print the table and redraw the chart of a results file")
    p.add_argument("--out", default=str(RESULTS / "serve.json"), help="JSON output (the PNG goes beside it)")
    return p.parse_args(argv)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def resolve_models(names: str) -> list[str]:
    """GGUF paths for --models: a path, a name ``lmserve models`` knows, or ``SHAPE:TYPE`` for a
    file of a real model's shapes that bench.synthetic writes (once, under bench/results/models)."""
    from shared.default_model import MODELS, model_path
    paths = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in MODELS:
            paths.append(str(model_path(name)))
        elif ":" in name and not os.path.exists(name):
            shape, qtype = name.split(":", 1)
            out = RESULTS / "models"
            target = out / f"{shape}-synthetic-{qtype}.gguf"
            if not target.exists():
                subprocess.run([sys.executable, "-m", "bench.synthetic", "write", shape, "--type", qtype,
                                "--out", str(out)], cwd=REPO, check=True)
            paths.append(str(target))
        else:
            paths.append(name)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        path = Path(args.render)
        report(json.loads(path.read_text()), path)
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    plan = QUICK if args.quick else FULL
    if args.cc_system:
        plan = dataclasses.replace(plan, cc_system=args.cc_system)
    if args.longer is not None:
        plan = dataclasses.replace(plan, longer_prompt=args.longer)
    plan = dataclasses.replace(plan, longest_prompt=args.longest, claude_code=not args.no_claude_code,
                               concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency
                               else plan.concurrency)
    repeats = args.repeats or (1 if args.quick else 3)
    from shared.default_model import default_model_path
    models = resolve_models(args.models) if args.models else [args.model or str(default_model_path())]
    external = dict(u.split("=", 1) for u in args.url)
    wanted = [s for s in args.servers.split(",") if s] if not external else list(external)
    unknown = [s for s in wanted if s not in SERVERS]
    if unknown:
        print(f"bench.serve: unknown server(s) {unknown}; names are {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    peer_bin = ensure_peer(find_peer_build(args.peer_build)) if PEER in wanted and PEER not in external else None
    documents = []
    for model in models:
        out = Path(args.out) if len(models) == 1 else Path(args.out).with_name(f"serve-{Path(model).stem}.json")
        documents.append(run_model(args, argv, model, plan, repeats, wanted, external, peer_bin, out))
    if args.floor:
        floor = memory_floor(args, resolve_models(args.floor)[0], wanted, peer_bin)
        print(floor["line"])
        for document in documents:
            document["meta"]["floor"] = floor
    if len(models) > 1 or args.floor:
        summary = summary_table(documents)
        print()
        print(summary)
        (Path(args.out).with_name("serve-summary.md")).write_text(summary + "\n")
        (Path(args.out).with_name("serve-summary.json")).write_text(json.dumps(
            {"models": [d["meta"] for d in documents], "rows": [d["rows"] for d in documents]}, indent=1) + "\n")
    return 0


def run_model(args: argparse.Namespace, argv: list[str] | None, model: str, plan: Plan, repeats: int,
              wanted: list[str], external: dict[str, str], peer_bin: Path | None, out: Path) -> dict[str, Any]:
    """Every repeat of every server on one model; lmserve starts first with an empty kernel cache
    (a first start on this machine), then from the one that start filled."""
    import tempfile
    print(f"bench.serve: preparing prompts from {Path(model).name}", flush=True)
    work = Workload(model, plan, nonce=int(time.time()) % 100_000)
    kernels: dict[str, Any] | None = None
    if peer_bin is not None:
        if args.quiet >= 0:
            wait_for_quiet(args.quiet, args.quiet_wait)
        kernels = peer_kernels(peer_bin, model, args.threads)
        print(f"bench.serve: {peer_kernel_line(kernels)}", flush=True)
    per_server: dict[str, list[RepeatFigures]] = {s: [] for s in wanted}
    loads: dict[str, list[dict[str, float]]] = {s: [] for s in wanted}
    commands: dict[str, list[str]] = {}
    notes: dict[str, dict[str, str]] = {}
    started_all = time.perf_counter()
    kernel_cache = tempfile.mkdtemp(prefix="lmserve-bench-kernels-")
    cold_start: float | None = None
    for repeat in range(repeats):
        for name in wanted:
            print(f"bench.serve: repeat {repeat + 1}/{repeats}, {name}", flush=True)
            proc = None
            sampler: MemorySampler | None = None
            before = wait_for_quiet(args.quiet, args.quiet_wait) if args.quiet >= 0 else None
            if name in external:
                base_url = external[name].rstrip("/")
            else:
                spec = (lmserve_spec(model, args.ctx, args.parallel, args.threads, args.kv_slots, kernel_cache)
                        if name == LMSERVE else peer_spec(peer_bin, model, args.ctx, args.parallel, args.threads))  # type: ignore[arg-type]
                commands[name] = spec.command
                if name == LMSERVE and cold_start is None:  # a first start: then it stops, and the repeats begin
                    first = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
                    cold_start = first.ready_after  # type: ignore[attr-defined]
                    stop_server(first)
                    print(f"bench.serve:   lmserve first start (empty kernel cache) ready in {cold_start:.1f} s",
                          flush=True)
                proc = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
                base_url = spec.base_url
            try:
                sampler = MemorySampler(proc.pid if proc else None).start()
                figs = asyncio.run(run_server_repeat(base_url, work, repeat, sampler if proc else None,
                                                     args.quiet, args.quiet_wait))
            except Exception as exc:
                if proc is not None and proc.poll() is not None and proc.returncode in (-4, 132):
                    print("bench.serve: the peer died of SIGILL: rebuild it (--peer-build) with "
                          f"CMAKE_ARGS={PEER_CMAKE_ARGS!r}", file=sys.stderr)
                raise RuntimeError(f"{name}, repeat {repeat + 1}: {exc}") from exc
            finally:
                load = sampler.stop() if sampler else {}
                if proc is not None:
                    stop_server(proc)
            if proc is not None:
                figs.values["start|warm"] = proc.ready_after  # type: ignore[attr-defined]
                if name == LMSERVE and repeat == 0:
                    figs.values["start|cold"] = cold_start
            loads[name].append({**load, "other_cores_before": before} if before is not None else load)
            per_server[name].append(figs)
            if "claude-code" in figs.checks:
                failed = str(figs.checks["claude-code"]).startswith("failed")
                notes.setdefault(name, {})["claude-code"] = (figs.checks["claude-code"] if failed
                                                             else "not served (no /v1/messages)")
                notes[name]["memory"] = "n/a"
            if "other_cores" in load:
                print(f"bench.serve:   other processes used {load['other_cores']:.2f} cores on average",
                      flush=True)
            print(f"bench.serve:   checks {json.dumps(figs.checks)}", flush=True)
            write_results(out, plan, per_server, notes, run_meta(args, argv, model, repeats, peer_bin,
                                                                 commands, loads, started_all, kernels))
    shutil.rmtree(kernel_cache, ignore_errors=True)
    document = write_results(out, plan, per_server, notes,
                             run_meta(args, argv, model, repeats, peer_bin, commands, loads, started_all, kernels))
    report(document, out)
    return document


def memory_floor(args: argparse.Namespace, model: str, wanted: list[str], peer_bin: Path | None) -> dict[str, Any]:
    """Both servers at their smallest useful setting (a 4096-token context, one KV slot), one
    short request: the peak memory of each (RSS and PSS sums over its processes)."""
    import httpx
    figures: dict[str, dict[str, float]] = {}
    for name in wanted:
        spec = (lmserve_spec(model, 4096, 1, args.threads, kv_slots=1) if name == LMSERVE
                else peer_spec(peer_bin, model, 4096, 1, args.threads))  # type: ignore[arg-type]
        proc = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
        sampler = MemorySampler(proc.pid).start()
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 16}
            httpx.post(spec.base_url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()
            time.sleep(1.0)
        finally:
            sampler.stop()
            stop_server(proc)
        figures[name] = {"rss": sampler.peak / 2**20, "pss": sampler.peak_pss / 2**20,
                         "by_process_pss": {k: round(v / 2**20, 1) for k, v in sampler.roles.items()}}
    line = "smallest setting (ctx 4096, one slot), peak memory: " + "; ".join(
        f"{n} RSS {f['rss']:.0f} MiB, PSS {f['pss']:.0f} MiB" for n, f in figures.items())
    if LMSERVE in figures and PEER in figures:
        line += (f"; ratio RSS {figures[LMSERVE]['rss'] / figures[PEER]['rss']:.2f}, "
                 f"PSS {figures[LMSERVE]['pss'] / figures[PEER]['pss']:.2f}")
    return {"model": Path(model).name, "servers": figures, "line": line}


SUMMARY = (  # (row key, what it shows) for the summary across models
    ("long cold|prefill", "prefill, cold ~2k prompt"),
    ("longest cold|ttft", "TTFT, cold 16k prompt (lower is better)"),
    ("short c=1|decode", "decode, 1 stream"),
    ("short c=4|aggregate", "aggregate, 4 streams"),
    ("memory|pss", "memory of the stack, PSS (lower is better)"),
    ("memory|chat", "memory of the stack, RSS (lower is better)"),
    ("start|warm", "start to ready (lower is better)"),
)


def summary_table(documents: list[dict[str, Any]]) -> str:
    """One markdown row per model: lmserve's median, llama.cpp's, and their ratio, per figure."""
    head = "| file | " + " | ".join(label for _, label in SUMMARY) + " | lmserve first start |"
    lines = [head, "|" + "---|" * (len(SUMMARY) + 2)]
    for document in documents:
        cells = []
        for key, _ in SUMMARY:
            ours, theirs, unit = medians(document, key)
            if ours is None:
                cells.append("—")
            elif theirs:
                cells.append(f"{_number(ours)} / {_number(theirs)} {unit} = {ours / theirs:.2f}")
            else:
                cells.append(f"{_number(ours)} {unit}")
        first, _, _ = medians(document, "start|cold")
        cells.append(f"{first:.1f} s" if first is not None else "—")
        lines.append(f"| {document['meta'].get('model')} | " + " | ".join(cells) + " |")
    floor = next((d["meta"]["floor"] for d in documents if d["meta"].get("floor")), None)
    if floor:
        lines.append("")
        lines.append(f"{floor['model']}: {floor['line']}")
    return "\n".join(lines)


def medians(document: dict[str, Any], key: str) -> tuple[float | None, float | None, str]:
    """(lmserve's median, llama.cpp's median, unit) of a figure, by its row key."""
    plan = Plan(**{**document["meta"]["plan"], "concurrency": tuple(document["meta"]["plan"]["concurrency"])})
    scenario, metric = key.split("|")
    if scenario.startswith("short"):
        c = int(scenario.split("=")[1])
        title = f"short+{plan.short_tokens}, {c} stream{'s' * (c > 1)}"
        label = {m: text for m, text, _, _ in ROW_SPECS}[metric]
    else:
        title = scenario_titles(plan)[scenario]
        label = {k: text for k, text, _, _ in OTHER_ROWS}[key]
    for row in document["rows"]:
        if row["scenario"] == title and row["metric"] == label:
            found = [statistics.median(row["servers"][s]["values"]) if row["servers"].get(s, {}).get("values")
                     else None for s in SERVERS]
            return found[0], found[1], row["unit"]
    return None, None, ""


def rows_from_json(document: dict[str, Any]) -> list[Row]:
    """The table rows back from a results document (the inverse of ``results_json``)."""
    rows = []
    for r in document["rows"]:
        row = Row(r["scenario"], r["metric"], r["unit"], r["better"])
        for server, cell in r["servers"].items():
            row.values[server] = list(cell.get("values", []))
            if "note" in cell:
                row.note[server] = cell["note"]
        rows.append(row)
    return rows


def load_summary(meta: dict[str, Any]) -> str | None:
    """Other processes' CPU use during the measured scenarios, from the results' checks."""
    readings = [v for runs in (meta.get("checks") or {}).values() for run in runs
                for v in (run.get("other cores per scenario") or {}).values() if v is not None]
    if not readings:
        return None
    busy = sum(v > 0.25 for v in readings)
    return (f"load from other processes during the scenarios: {statistics.median(readings):.2f} cores median, "
            f"{max(readings):.2f} max (of {(meta.get('machine') or {}).get('cores', '?')}); "
            f"{busy} of {len(readings)} scenario runs had more than 0.25 cores of it")


def cpu_has_amx_int8() -> bool:
    try:
        return any(line.startswith("flags") and " amx_int8" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def kernel_path(has_amx: bool, cmake_args: str) -> str:
    """Which KERNEL_REFERENCES row applies: AMX only on a CPU that has it, in a build that keeps it."""
    return "AMX int8" if has_amx and "-mno-amx-int8" not in cmake_args else "without AMX"


def peer_kernels(binaries: Path, model: str, threads: int) -> dict[str, Any]:
    """The peer build's pp512 / tg128 (tok/s) on this machine, measured by its llama-bench, and
    the reference they are held to (llama.cpp's figures are for the default model only)."""
    out = subprocess.run([str(binaries / "llama-bench"), "-m", model, "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=900)
    figures = {}
    for test in json.loads(out.stdout):
        name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        figures[name] = float(test["avg_ts"])
    path = kernel_path(cpu_has_amx_int8(), PEER_CMAKE_ARGS)
    from shared.default_model import default_model_path
    if Path(model).name != default_model_path().name:
        return {**figures, "path": path, "references": None}
    return {**figures, "path": path, "references": {k: list(v) for k, v in KERNEL_REFERENCES[path].items()}}


def peer_kernel_line(kernels: dict[str, Any]) -> str:
    """The peer's kernel speed next to llama.cpp's own figures for the same path, with a verdict.

    A peer slower than its reference is misbuilt or starved, and the comparison flatters lmserve;
    a faster one (another CPU than the reference's) only makes the comparison harder on lmserve.
    """
    if kernels.get("references") is None:
        figures = "; ".join(f"{name} {kernels[name]:.0f}" for name in ("pp512", "tg128"))
        return f"llama.cpp kernels, {kernels['path']} path, 2 cores: {figures} tok/s (no reference for this file)"
    parts, slow, fast = [], [], []
    for name in ("pp512", "tg128"):
        lo, hi = kernels["references"][name]
        value = kernels[name]
        parts.append(f"{name} {value:.0f} (reference {lo:.0f}-{hi:.0f})")
        if value < lo * (1 - KERNEL_TOLERANCE):
            slow.append(name)
        elif value > hi * (1 + KERNEL_TOLERANCE):
            fast.append(name)
    if slow:
        verdict = f"TOO SLOW in {', '.join(slow)}: misbuilt or starved, do not trust the comparison"
    elif fast:
        verdict = f"faster than the reference in {', '.join(fast)} (a faster CPU): the comparison stands"
    else:
        verdict = f"within {KERNEL_TOLERANCE:.0%} of the reference"
    return f"llama.cpp kernels, {kernels['path']} path, 2 cores: {'; '.join(parts)} tok/s: {verdict}"


def peer_sanity_line(median: float, kernels: dict[str, Any] | None = None) -> str:
    """The peer's single-stream decode through its server, next to its own kernels' tg128 when
    measured in the same run (the gap is the server's cost per token), else next to
    llama.cpp's figures for the reference machine."""
    if kernels is not None:
        return (f"llama.cpp single-stream decode through llama-server: {median:.1f} tok/s, "
                f"{median / kernels['tg128']:.0%} of its kernels' tg128 ({kernels['tg128']:.0f} tok/s) in this run")
    references = "; ".join(f"{name}: {lo:.0f}-{hi:.0f}" for name, (lo, hi) in PEER_REFERENCES.items())
    floor = min(lo for lo, _ in PEER_REFERENCES.values()) * 0.85
    verdict = "plausible" if median >= floor else "TOO LOW: misbuilt or starved?"
    return (f"llama.cpp single-stream decode: {median:.1f} tok/s ({verdict}; on 2 Sapphire Rapids cores, "
            f"{references} tok/s)")


def report(document: dict[str, Any], out: Path) -> None:
    """Print the table and the sanity lines; draw the chart beside the JSON."""
    meta = document["meta"]
    rows = rows_from_json(document)
    done = meta.get("repeats_done") or {}
    print()
    print(f"serving benchmark, {meta.get('model')}, {meta.get('threads')} threads, ctx {meta.get('ctx')}, "
          f"repeats {done or meta.get('repeats')}; median (min-max) over repeats")
    print(format_text_table(rows, document["servers"]))
    summary = load_summary(meta)
    if summary:
        print(summary)
    if meta.get("peer_kernels"):
        print(peer_kernel_line(meta["peer_kernels"]))
    peer_single = meta.get("peer_single_stream_decode")
    if peer_single is not None:
        print(peer_sanity_line(peer_single["median"], meta.get("peer_kernels")))
    png = out.with_suffix(".png")
    title = f"lmserve vs llama.cpp ({PEER_PACKAGE}), {meta.get('model')}, {meta.get('threads')} threads"
    if write_chart(rows, png, title):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out}")


def run_meta(args: argparse.Namespace, argv: list[str] | None, model: str, repeats: int, peer_bin: Path | None,
             commands: dict[str, list[str]], loads: dict[str, list[dict[str, float]]],
             started_all: float, kernels: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "command": "python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "duration_s": round(time.perf_counter() - started_all),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "cpu_flags": sorted(cpu_flags())},
        "model": Path(model).name, "repeats": repeats, "quick": args.quick, "ctx": args.ctx,
        "threads": args.threads, "parallel": args.parallel, "lmserve_revision": _git_revision(),
        "peer": {"server": "llama-server", "source": f"{PEER_PACKAGE} {PEER_VERSION} sdist",
                 "version": peer_version(peer_bin) if peer_bin else None, "cmake": PEER_CMAKE_ARGS,
                 "parallel_slots": args.parallel},
        "peer_kernels": kernels,
        "server_commands": commands,
        "load": loads,
    }


def write_results(out: Path, plan: Plan, per_server: dict[str, list[RepeatFigures]],
                  notes: dict[str, dict[str, str]], meta: dict[str, Any]) -> dict[str, Any]:
    """Write the JSON (after every server run, so an interrupted run keeps what it measured)."""
    rows = build_rows(plan, per_server, notes)
    meta = {**meta, "plan": dataclasses.asdict(plan), "repeats_done": {s: len(r) for s, r in per_server.items()},
            "checks": {s: [r.checks for r in reps] for s, reps in per_server.items()}}
    single = next((r for r in rows if r.scenario.endswith(", 1 stream") and r.metric == "decode per stream"), None)
    peer_single = single.spread(PEER) if single else None
    if peer_single is not None:
        meta["peer_single_stream_decode"] = {"median": peer_single.median,
                                             "references": {k: list(v) for k, v in PEER_REFERENCES.items()}}
    servers = [s for s in SERVERS if s in per_server]
    document = results_json(rows, meta, servers)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(partial, out)
    return document


if __name__ == "__main__":
    raise SystemExit(main())
