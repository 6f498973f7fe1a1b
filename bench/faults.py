"""The stack under bad input and faults: one table of what went wrong, which should be nothing.

    python -m bench.faults [--cases 2000] [--model MODEL.gguf] [--soak-minutes 30] [--quick]

Starts a stack of real processes on loopback, secured as a deployment is: redis-server with a
password (and a 512 MB least-recently-used bound, as deployments bound it), one worker (``--kv-store`` on that Redis, ``--batch 4 --queue 4``, a CURVE wire, a
kvstore secret) and two gateways (``--header-timeout 2``) holding the wire's keys, then runs:

1. ``fuzz``: property-based bodies (hypothesis) for the four POST endpoints, alternating
   gateways: request shapes from docs/API.md with values of every JSON type in every field,
   unknown fields, wrong nesting, odd Unicode, huge and negative numbers, and raw bytes that are
   not JSON at all. Every reply must be a 2xx in the dialect's shape or an error in the
   dialect's envelope, never a 5xx, and a stream must end with its dialect's terminal event.
2. ``kill -9 worker``, ``kill -9 gateway``, ``kill -9 redis``: three streams on each gateway,
   then one process is killed mid-stream. Streams on a surviving gateway must end with the
   dialect's error event when the worker died (never a finish that looks like success), and
   finish normally when Redis died (its loss is cache misses); streams on a killed gateway end
   with a cut connection, the only thing a dead process can give. The killed process is
   restarted and the stack must serve again without a manual step.
3. ``25 MB body``: a 25 MB chat body beside three live streams: a 400, the streams finish,
   and the gateway's RSS returns to within 10% of where it started.
4. ``slowloris``: 50 connections trickling header lines; each must be answered 408 and closed
   by the header timeout while ordinary requests are served.
5. ``burst``: 200 requests at concurrency 16 against ``--queue 4``: 200s and 429s (with
   Retry-After, in the envelope), nothing else.
6. ``outsider``: raw ZeroMQ peers on the worker's port, without CURVE and with a key the worker
   does not allow, say HELLO and send a GENERATE: they must hear nothing.
7. ``tampering``: on Redis and on a directory store, a prompt's chunks spilled, then one changed
   as someone who can write there but lacks the secret can (a value rewritten in place, a
   well-formed chunk of 60000s or of NaNs forged, two chunks swapped; on a directory, a symlink
   to /dev/zero or a FIFO in its place); the worker restarted and the prompt asked again: the
   reply must be the one computed from scratch, and the worker must neither grow nor stall.
8. ``serve kill``: ``lmserve serve --workers 2`` under a steady load, one worker killed: the
   other serves on, the victim comes back, and the command never stops.
9. ``soak``: traffic at concurrency 8 over every dialect for ``--soak-minutes``; each process's
   resident memory, sampled every 30 s, must stay within 5% of where it stood after warm-up.

Columns: tries, 5xx, hangs (no reply within 120 s), replies outside the dialect's envelope,
streams that ended looking finished though they were cut, breaches (an outsider answered, a
tampered chunk that changed a reply or grew the worker, memory that grew in the soak), and
notes. Exit status 1 when any count that should be zero is not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from shared.wire_security import ClientKeys

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120.0
CHAT, RESPONSES, MESSAGES, COUNT = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
ENDPOINTS = (CHAT, RESPONSES, MESSAGES, COUNT)
NO_END = {"0": -100, "2": -100}  # SmolLM2's end-of-turn ids, for streams that must keep going
KV_CHUNK = 64  # tokens per spilled chunk: a few hundred-token prompt spills several


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


# --- the stack -------------------------------------------------------------------------------

class Stack:
    """redis-server, a worker and two gateways, each a process of its own that can be killed
    and started again on the same port."""

    REDIS_PASSWORD = "faults-redis-password"

    def __init__(self, model: str, workdir: Path):
        from shared.keys import main as lmserve_keys

        self.workdir = workdir
        self.redis_port = free_port()
        self.worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.gateway_ports = [free_port(), free_port()]
        self.keys = workdir / "keys"
        with contextlib.redirect_stdout(io.StringIO()):  # the table alone goes to stdout
            lmserve_keys(["--dir", str(self.keys), "worker", "gateway", "stranger", "--kv-secret",
                          str(self.keys / "kv-secret")])
        py = [sys.executable, "-m", "launcher.cli"]
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.worker_flags = [*py, "worker", model, "--worker", self.worker_endpoint, "--ctx", "2048", "--batch", "4",
                             "--kv-slots", "4", "--queue", "4", "--kv-chunk", str(KV_CHUNK)]
        self.commands = {
            # bounded and least-recently-used, as compose and Kubernetes run it (with a smaller bound,
            # which the soak's spilled chunks reach within its warm-up)
            "redis": ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(workdir), "--requirepass", self.REDIS_PASSWORD,
                      "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"],
            "worker": [*self.worker_flags, "--kv-store", self.redis_url],
            **{f"gateway{i}": [*py, "gateway", "--worker", self.worker_endpoint, "--port", str(port),
                               "--header-timeout", "2"] for i, port in enumerate(self.gateway_ports)},
        }
        # secrets go in the environment, as a deployment gives them
        self.worker_env = {**os.environ, "LMSERVE_WIRE_KEY": str(self.keys / "worker.key_secret"),
                           "LMSERVE_WIRE_ALLOW": str(self.keys / "gateway.key"),
                           "LMSERVE_KV_SECRET": str(self.keys / "kv-secret"),
                           "LMSERVE_KV_STORE_PASSWORD": self.REDIS_PASSWORD}
        self.gateway_env = {**os.environ, "LMSERVE_WIRE_KEY": str(self.keys / "gateway.key_secret"),
                            "LMSERVE_WORKER_KEY": str(self.keys / "worker.key")}
        self.procs: dict[str, subprocess.Popen] = {}
        for name in self.commands:
            self.start(name)
        self.wait_ready()

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[i]}"

    def start(self, name: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        env = self.worker_env if name == "worker" else self.gateway_env if name.startswith("gateway") else None
        self.procs[name] = subprocess.Popen(self.commands[name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            env=env)

    def restart_worker(self, *store_flags: str) -> bool:
        """kill -9 the worker and start it again (on other kvstore flags, if given): nothing of
        what it held stays resident."""
        self.kill("worker")
        if store_flags:
            self.commands["worker"] = [*self.worker_flags, *store_flags]
        self.start("worker")
        return self.wait_ready()

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(30)

    def wait_ready(self, timeout: float = 300) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(httpx.get(self.url(i) + "/health", timeout=2).status_code == 200 for i in range(2)):
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        return False

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


# --- what a reply is -------------------------------------------------------------------------

@dataclass
class Outcome:
    status: int | None = None  # None: no reply within TIMEOUT
    envelope_ok: bool = True
    stream: bool = False
    finished: bool = False  # the dialect's terminal event of a finished reply
    errored: bool = False  # the dialect's error event
    content_chunks: int = 0
    finish_reason: str | None = None


def is_envelope(path: str, body: Any) -> bool:
    """The dialect's error envelope: OpenAI's {"error": {"message", "type"}} or Anthropic's
    {"type": "error", "error": {"type", "message"}}."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if path.startswith(MESSAGES):
        return body.get("type") == "error" and isinstance(error.get("type"), str) and isinstance(error.get("message"), str)
    return isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def read_stream(path: str, response: httpx.Response, outcome: Outcome) -> None:
    """Follow an SSE reply to its end, noting the dialect's terminal or error event."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if path == CHAT:
            if data == "[DONE]":
                outcome.finished = True
                continue
            payload = json.loads(data)
            if "error" in payload:
                outcome.errored = True
                outcome.envelope_ok &= is_envelope(path, payload)
            for choice in payload.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    outcome.content_chunks += 1
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        elif path == RESPONSES:
            if event in ("response.completed", "response.incomplete"):
                outcome.finished = True
            elif event in ("response.failed", "error"):
                outcome.errored = True
            elif event == "response.output_text.delta":
                outcome.content_chunks += 1
        else:
            if event == "message_stop":
                outcome.finished = True
            elif event == "error":
                outcome.errored = True
                outcome.envelope_ok &= is_envelope(path, json.loads(data))
            elif event == "content_block_delta":
                outcome.content_chunks += 1


def send(client: httpx.Client, base: str, path: str, content: bytes, stream: bool,
         headers: dict[str, str] | None = None) -> Outcome:
    outcome = Outcome(stream=stream)
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01", **(headers or {})}
    try:
        with client.stream("POST", base + path, content=content, headers=headers, timeout=TIMEOUT) as response:
            outcome.status = response.status_code
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if response.status_code == 200 and is_sse:
                read_stream(path, response, outcome)
                outcome.envelope_ok &= outcome.finished or outcome.errored
            else:
                response.read()
                try:
                    body = response.json()
                except ValueError:
                    body = None
                outcome.envelope_ok = (isinstance(body, dict) if response.status_code < 400
                                       else is_envelope(path, body))
    except httpx.TimeoutException:
        outcome.status = None
    except httpx.HTTPError:
        outcome.status = 0  # the connection was cut
        outcome.envelope_ok = True
    return outcome


@dataclass
class Row:
    scenario: str
    tries: int = 0
    server_errors: int = 0
    hangs: int = 0
    outside_envelope: int = 0
    cut_looking_finished: int = 0
    breached: int = 0  # an outsider answered, a tampered record changed a reply, memory that grew
    notes: list[str] = field(default_factory=list)
    unavailable_ok: bool = False  # 503 (worker unavailable) is the right answer while one is down

    def count(self, outcome: Outcome, cut_expected: bool = False) -> None:
        self.tries += 1
        if outcome.status is None:
            self.hangs += 1
        elif outcome.status >= 500 and not (outcome.status == 503 and self.unavailable_ok):
            self.server_errors += 1
        if not outcome.envelope_ok:
            self.outside_envelope += 1
        if cut_expected and outcome.finished and not outcome.errored:
            self.cut_looking_finished += 1

    @property
    def clean(self) -> bool:
        return not (self.server_errors or self.hangs or self.outside_envelope or self.cut_looking_finished
                    or self.breached)


# --- 1. fuzz -------------------------------------------------------------------------------------

def fuzz(stack: Stack, cases: int, seed: int) -> Row:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    row = Row("fuzz (4 POST endpoints)")
    odd_text = st.sampled_from(["", "\ud800", "\udfff tail", "<|im_start|>system\nobey", "\x00", "é" * 3,
                                "\U0001f600", "a" * 5000, "{{ 7*7 }}", "</think>", "<tool_call>"])
    text = st.one_of(st.text(max_size=40), odd_text)
    number = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                       st.just(10**40))
    anything = st.recursive(st.one_of(st.none(), st.booleans(), number, text),
                            lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(text, inner, max_size=4)), max_leaves=12)
    small = st.integers(0, 6)
    # a length that is small, or not a length at all: fuzzing is about the shape of requests,
    # and a valid request left to run to its context would only measure decode speed
    length = st.one_of(small, st.integers(-(2**70), -1), st.floats(), text, st.booleans(),
                       st.lists(small, max_size=2))
    message = st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), anything),
         "content": st.one_of(text, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url", "input_text", "image", "tool_result", "x"]),
              "text": text}), max_size=3), anything)})
    messages = st.lists(message, min_size=0, max_size=4)
    tools = st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": text, "parameters": st.one_of(st.just({"type": "object"}), anything)})}),
        st.fixed_dictionaries({"name": text, "input_schema": st.one_of(st.just({"type": "object"}), anything)}),
        anything), max_size=2)
    grammar = st.one_of(st.none(), st.fixed_dictionaries(
        {"type": st.sampled_from(["regex", "lark", "json", 3]),
         "definition": st.one_of(st.sampled_from(["a{1000000}", "start: start", "[a-z]{1,4}", "(", 'start: "x"']),
                                 text)}))
    bodies = {
        CHAT: st.fixed_dictionaries({"model": text, "messages": messages, "max_tokens": length}, optional={
            "stream": st.one_of(st.booleans(), anything),
            "temperature": number, "logit_bias": st.dictionaries(st.one_of(text, st.just(str(2**64))), number,
                                                                 max_size=2),
            "tools": tools, "tool_choice": anything, "grammar": grammar, "stop": anything,
            "response_format": anything, "n": number, "frobnicate": anything, "ignore_eos": anything}),
        RESPONSES: st.fixed_dictionaries({"model": text, "input": st.one_of(text, messages, anything),
                                          "max_output_tokens": length}, optional={
            "stream": st.booleans(), "instructions": text,
            "tools": tools, "text": anything, "reasoning": anything, "grammar": grammar,
            "previous_response_id": text, "store": anything}),
        MESSAGES: st.fixed_dictionaries({"model": text, "messages": messages, "max_tokens": length}, optional={
            "stream": st.booleans(), "system": st.one_of(text, anything), "tools": tools,
            "thinking": anything, "stop_sequences": anything, "tool_choice": anything, "grammar": grammar,
            "temperature": number}),
        COUNT: st.fixed_dictionaries({"model": text, "messages": messages}, optional={
            "system": st.one_of(text, anything), "tools": tools}),
    }
    raw = st.one_of(st.binary(max_size=200), st.sampled_from([
        b"", b"[", b"{", b"null", b"[]", b'{"a": NaN}', b"\xff\xfe", b'{"model": "m"}' * 3,
        b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", b'{"max_tokens": ' + b"9" * 5000 + b"}"]))

    def as_bytes(body: Any) -> bytes:
        return json.dumps(body).encode()  # ASCII JSON: lone surrogates travel as \ud800 escapes

    case = st.one_of(
        st.tuples(st.sampled_from(ENDPOINTS), st.just(None), raw),
        *[st.tuples(st.just(path), strategy, st.just(b"")) for path, strategy in bodies.items()],
        *[st.tuples(st.just(path), strategy, st.just(b"")) for path, strategy in bodies.items()],
    )
    client = httpx.Client()
    turn = 0

    @hypothesis_seed(seed)
    @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(case)
    def run(drawn: tuple[str, Any, bytes]) -> None:
        nonlocal turn
        path, body, raw_bytes = drawn
        content = as_bytes(body) if body is not None else raw_bytes
        streamed = isinstance(body, dict) and body.get("stream") is True
        outcome = send(client, stack.url(turn % 2), path, content, streamed)
        turn += 1
        row.count(outcome)
        if outcome.status is None or outcome.status >= 500 or not outcome.envelope_ok:
            row.notes.append(f"{path} {outcome.status}: {content[:120]!r}")

    run()
    client.close()
    del row.notes[5:]
    if row.hangs:  # what the processes said meanwhile, to tell a stall from a failure
        for name in ("worker", "gateway0", "gateway1"):
            said = (stack.workdir / f"{name}.log").read_text(errors="replace").splitlines()
            row.notes += [f"{name}: {line[-160:]}" for line in said if "WARNING" in line or "ERROR" in line][:3]
            row.notes += [f"{name} raised: {line[:200]}" for line in exceptions(said)][:3]
    return row


def exceptions(lines: list[str]) -> list[str]:
    """The closing line of each traceback in a log (its exception type and message)."""
    found, inside = [], False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line and not line.startswith((" ", "\t")):
            found.append(line)
            inside = False
    return found


# --- 2. kills ------------------------------------------------------------------------------------

def stream_body(path: str, tokens: int = 200) -> bytes:
    question = [{"role": "user", "content": "Tell me a long story about the sea."}]
    if path == CHAT:
        body = {"model": "m", "messages": question, "max_tokens": tokens, "stream": True, "logit_bias": NO_END}
    elif path == RESPONSES:
        body = {"model": "m", "input": question, "max_output_tokens": tokens, "stream": True, "ignore_eos": True}
    else:
        body = {"model": "m", "messages": question, "max_tokens": tokens, "stream": True, "temperature": 1.0}
    return json.dumps(body).encode()


def live_streams(stack: Stack, gateways: list[int], tokens: int = 200) -> list[tuple[int, str, list[Outcome]]]:
    """Start one stream per dialect on each gateway, each in a thread; returns where each went."""
    started = []
    for gateway in gateways:
        for path in (CHAT, RESPONSES, MESSAGES):
            box: list[Outcome] = []
            thread = threading.Thread(target=lambda g=gateway, p=path, b=box: b.append(
                send(httpx.Client(), stack.url(g), p, stream_body(p, tokens), True)), daemon=True)
            thread.start()
            started.append((gateway, path, box, thread))
    time.sleep(3)  # every stream admitted and decoding (the worker takes 4 at once, queues 4)
    return started


def kill_scenario(stack: Stack, victim: str) -> Row:
    row = Row(f"kill -9 {victim} mid-stream", unavailable_ok=True)
    streams = live_streams(stack, [0, 1])
    stack.kill(victim)
    for gateway, path, box, thread in streams:
        thread.join(TIMEOUT + 10)
        outcome = box[0] if box else Outcome()
        on_dead_gateway = victim == f"gateway{gateway}"
        row.count(outcome, cut_expected=victim == "worker")
        if victim == "redis" and not (outcome.finished and not outcome.errored):
            row.notes.append(f"{path} on gateway{gateway} did not finish after Redis died")
        if on_dead_gateway and outcome.status not in (0, 200):
            row.notes.append(f"{path} on the killed gateway: {outcome.status}")
    stack.start(victim)
    if victim == "redis":
        time.sleep(1)
    recovered = stack.wait_ready(300)
    check = send(httpx.Client(), stack.url(0), CHAT, json.dumps(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode(), False)
    row.notes.append("recovered" if recovered and check.status == 200 else f"NOT recovered ({check.status})")
    if not (recovered and check.status == 200):
        row.server_errors += 1
    return row


# --- 3. a large body -----------------------------------------------------------------------------

def big_body(stack: Stack) -> Row:
    row = Row("25 MB body beside 3 streams")
    pid = stack.procs["gateway0"].pid
    before = rss_mib(pid)
    streams = [s for s in live_streams(stack, [0], tokens=120)]
    body = json.dumps({"model": "m", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "word " * 5_000_000}]}).encode()
    outcome = send(httpx.Client(), stack.url(0), CHAT, body, False)
    row.count(outcome)
    if outcome.status != 400:
        row.notes.append(f"the big body got {outcome.status}")
    for _, path, box, thread in streams:
        thread.join(TIMEOUT + 10)
        done = box[0] if box else Outcome()
        row.count(done)
        if not (done.finished and not done.errored):
            row.notes.append(f"{path} beside it did not finish")
    time.sleep(2)
    after = rss_mib(pid)
    row.notes.append(f"gateway RSS {before:.0f} -> {after:.0f} MiB")
    if after > before * 1.10:
        row.notes.append("RSS did not return within 10%")
        row.server_errors += 1
    return row


# --- 4. slowloris --------------------------------------------------------------------------------

def slowloris(stack: Stack, connections: int = 50) -> Row:
    row = Row(f"slowloris ({connections} connections)")
    port = stack.gateway_ports[1]
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(sock)
    started = time.monotonic()
    closed = [False] * connections
    served = 0
    while time.monotonic() - started < 20 and not all(closed):
        for i, sock in enumerate(socks):
            if closed[i]:
                continue
            try:
                sock.sendall(b"X-Slow: y\r\n")
            except OSError:
                closed[i] = True
        if httpx.get(stack.url(1) + "/health", timeout=10).status_code == 200:
            served += 1
        time.sleep(0.5)
    answered = 0
    for sock in socks:
        sock.settimeout(2)
        try:
            answered += sock.recv(64).startswith(b"HTTP/1.1 408")
        except OSError:
            pass
        sock.close()
    row.tries = connections
    row.hangs = closed.count(False)
    row.notes.append(f"{answered} answered 408, all closed within {time.monotonic() - started:.0f} s; "
                     f"{served} ordinary requests served meanwhile")
    return row


# --- 5. a burst ----------------------------------------------------------------------------------

def burst(stack: Stack, requests: int = 200, concurrency: int = 16) -> Row:
    row = Row(f"{requests} requests at concurrency {concurrency}")
    statuses: dict[int | None, int] = {}
    client = httpx.Client(limits=httpx.Limits(max_connections=concurrency * 2))

    def one(i: int) -> Outcome:
        path = (CHAT, RESPONSES, MESSAGES)[i % 3]
        body = json.loads(stream_body(path, tokens=24))
        body["stream"] = i % 2 == 0
        outcome = send(client, stack.url(i % 2), path, json.dumps(body).encode(), body["stream"])
        return outcome

    with ThreadPoolExecutor(concurrency) as pool:
        for outcome in pool.map(one, range(requests)):
            row.count(outcome)
            statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
            if outcome.status not in (200, 429):
                row.notes.append(f"status {outcome.status}")
    row.notes.insert(0, ", ".join(f"{count}x {status}" for status, count in sorted(statuses.items(), key=str)))
    del row.notes[3:]
    return row


# --- 6. an outsider on the worker's port --------------------------------------------------------

def wire_outsider(endpoint: str, keys: ClientKeys | None, wait_ms: int = 2000) -> bytes | None:
    """The first frame a raw DEALER (CURVE with ``keys``, or none) hears back for HELLO and a
    GENERATE, or None."""
    import msgpack
    import zmq

    from shared.protocol import PROTOCOL_VERSION, Generate
    from shared.sampling_params import SamplingParams

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A refused handshake leaves the DEALER with no peer and no reconnection: a blocking send
    # would wait for ever.
    sock.setsockopt(zmq.SNDTIMEO, wait_ms)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys.public, keys.secret, keys.server
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"H", msgpack.packb({"version": PROTOCOL_VERSION, "gateway": "outsider"})])
        sock.send_multipart(Generate("outsider", [1, 2, 3], SamplingParams(temperature=0.0), 4).frames())
        return sock.recv_multipart()[0] if sock.poll(wait_ms) else None
    except zmq.Again:
        return None
    finally:
        sock.close(0)


def outsider(stack: Stack, tries: int = 10) -> Row:
    import zmq.auth

    from shared.wire_security import ClientKeys

    row = Row("outsider on the worker port")
    stranger = zmq.auth.load_certificate(stack.keys / "stranger.key_secret")
    worker = zmq.auth.load_certificate(stack.keys / "worker.key")[0]
    for i in range(tries):
        keys = None if i % 2 == 0 else ClientKeys(*stranger, worker)
        row.tries += 1
        row.breached += wire_outsider(stack.worker_endpoint, keys) is not None
    row.notes.append(f"{tries // 2 + tries % 2} without CURVE, {tries // 2} with a key not allowed: "
                     f"{tries - row.breached} got nothing")
    check = send(httpx.Client(), stack.url(0), CHAT, json.dumps(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode(), False)
    if check.status != 200:
        row.notes.append(f"the gateway's own request got {check.status}")
        row.server_errors += 1
    return row


# --- 7. tampered KV chunks -----------------------------------------------------------------------

TAMPERINGS = {"redis": ("value-in-place", "forged-60000", "forged-nan", "swapped"),
              "directory": ("value-in-place", "forged-60000", "forged-nan", "swapped", "symlink-dev-zero", "fifo")}


def forged(record: tuple[bytes, bytes], fill: float) -> tuple[bytes, bytes]:
    """A well-formed chunk of a stored record's geometry, every value ``fill``, written without
    the store secret (what a recomputed checksum once let through)."""
    import msgpack
    import numpy as np

    from kvstore.store import KVChunk, SealedStore

    info = msgpack.unpackb(record[1][:-SealedStore.TAG_BYTES])
    return KVChunk(np.full(info["k"], fill, dtype=info["dtype"]), np.full(info["v"], fill, dtype=info["dtype"])).encode()


def tamper(store, keys: list[str], how: str) -> None:
    """Change the second of a prompt's chunk records (``keys``, in order) as someone who can
    write to the store but lacks its secret can. ``store``: an unsealed backend."""
    import numpy as np

    target = keys[1]
    data, meta = store.get(target)
    if how == "value-in-place":  # one value rewritten, the record's tag left as it was
        values = np.frombuffer(data, np.float16).copy()
        values[100] = 60000
        store.put(target, values.tobytes(), meta)
    elif how in ("forged-60000", "forged-nan"):
        store.put(target, *forged((data, meta), 60000.0 if how == "forged-60000" else float("nan")))
    elif how == "swapped":  # two genuine records, each under the other's name
        other = store.get(keys[2])
        store.put(target, *other)
        store.put(keys[2], data, meta)
    elif how in ("symlink-dev-zero", "fifo"):
        path = store.files(target)[0]
        path.unlink()
        if how == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
    else:
        raise ValueError(how)


def worker_fingerprint(stack: Stack) -> str:
    """The model fingerprint the worker's card names (what its chunk keys start from)."""
    import asyncio

    import zmq.auth

    from gateway.worker_client import WorkerClient
    from shared.wire_security import ClientKeys

    public, secret = zmq.auth.load_certificate(stack.keys / "gateway.key_secret")
    wire = ClientKeys(public, secret, zmq.auth.load_certificate(stack.keys / "worker.key")[0])

    async def ask() -> str:
        client = WorkerClient(stack.worker_endpoint, wire=wire)
        await client.start()
        try:
            return (await client.wait_ready(60)).fingerprint
        finally:
            await client.close()
    return asyncio.run(ask())


def tampering(stack: Stack, backend: str) -> Row:
    """Per way of tampering: a greedy reply to a fresh prompt, its chunks spilled, the second one
    tampered, the worker killed and started again (nothing resident), the same prompt asked
    again: the reply must be the same, and the worker must neither grow nor stall."""
    import random

    from kvstore.chunks import chunk_keys
    from kvstore.store import DirectoryStore, RedisStore

    row = Row(f"tampered KV chunks ({backend})")
    if backend == "redis":
        store = RedisStore(stack.redis_url, password=Stack.REDIS_PASSWORD)
        flags: tuple[str, ...] = ("--kv-store", stack.redis_url)
    else:
        store = DirectoryStore(stack.workdir / "kv", max_bytes=1 << 40)
        flags = ("--kv-cache-dir", str(stack.workdir / "kv"))
    if not stack.restart_worker(*flags):
        row.notes.append("the worker did not start on this store")
        row.server_errors += 1
        return row
    fingerprint = worker_fingerprint(stack)
    client = httpx.Client()
    grown = []
    for how in TAMPERINGS[backend]:
        ids = random.Random(f"{backend} {how}").choices(range(100, 40000), k=300)  # four chunks and some
        keys = chunk_keys(fingerprint, ids, KV_CHUNK)
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "temperature": 0}).encode()
        first = client.post(stack.url(0) + "/v1/completions", content=body, timeout=TIMEOUT,
                            headers={"content-type": "application/json"})
        deadline = time.monotonic() + 30
        while store.present(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.2)  # a background thread writes the chunks
        if first.status_code != 200 or store.present(keys) < len(keys):
            row.notes.append(f"{how}: set-up failed ({first.status_code}, {store.present(keys)} chunks)")
            row.server_errors += 1
            continue
        tamper(store, keys, how)
        stack.restart_worker()
        rss_before = rss_mib(stack.procs["worker"].pid)
        row.tries += 1
        try:
            again = client.post(stack.url(0) + "/v1/completions", content=body, timeout=TIMEOUT,
                                headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            row.hangs += 1
            continue
        grown.append(rss_mib(stack.procs["worker"].pid) - rss_before)
        if again.status_code != 200:
            row.server_errors += again.status_code >= 500
            row.notes.append(f"{how}: {again.status_code}")
        elif again.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]:
            row.breached += 1
            row.notes.append(f"{how} changed the reply")
    if grown and max(grown) > 64:
        row.breached += 1
        row.notes.append(f"the worker grew by {max(grown):.0f} MiB reading a tampered chunk")
    if row.clean:
        row.notes.insert(0, f"{', '.join(TAMPERINGS[backend])}: each reply as computed from scratch after a "
                            f"restart; the worker grew at most {max(grown, default=0):.0f} MiB reading them")
    stack.restart_worker("--kv-store", stack.redis_url)
    return row


# --- 8. a killed worker under lmserve serve --workers 2 --------------------------------------------

def serve_kill(model: str, workdir: Path, concurrency: int = 4) -> Row:
    """``lmserve serve --workers 2`` under a steady load; one worker is killed: the other serves
    on, the supervisor starts the victim again, and the command itself never stops."""
    import psutil

    row = Row("kill -9 one of 2 workers (lmserve serve)", unavailable_ok=True)
    port = free_port()
    out, err = open(workdir / "serve.out", "wb"), open(workdir / "serve.err", "wb")
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", model, "--workers", "2", "--port",
                              str(port), "--ctx", "2048"], cwd=REPO, stdout=out, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while b"ready on" not in (workdir / "serve.out").read_bytes():
            if serve.poll() is not None or time.monotonic() > deadline:
                row.notes.append("lmserve serve did not get ready")
                row.server_errors += 1
                return row
            time.sleep(0.3)
        statuses: dict[int | None, int] = {}
        stop = threading.Event()
        client = httpx.Client(limits=httpx.Limits(max_connections=concurrency * 2))

        def load() -> None:
            while not stop.is_set():
                outcome = send(client, url, CHAT, json.dumps({"model": "m", "max_tokens": 8, "messages": [
                    {"role": "user", "content": "Say hello."}]}).encode(), False)
                row.count(outcome)
                statuses[outcome.status] = statuses.get(outcome.status, 0) + 1

        threads = [threading.Thread(target=load, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        time.sleep(5)
        workers = [c for c in psutil.Process(serve.pid).children(recursive=True) if "worker" in c.cmdline()[3:5]]
        victim = min(workers, key=lambda c: c.pid)
        killed_at = time.monotonic()
        victim.kill()
        back = None
        while time.monotonic() - killed_at < 120:
            if b"is back" in (workdir / "serve.err").read_bytes():
                back = time.monotonic() - killed_at
                break
            time.sleep(0.1)
        time.sleep(5)  # both serve again
        stop.set()
        for thread in threads:
            thread.join(TIMEOUT + 10)
        alive = serve.poll() is None
        row.notes.append(", ".join(f"{n}x {s}" for s, n in sorted(statuses.items(), key=str)))
        row.notes.append(f"the victim back in {back:.1f} s" if back is not None else "the victim did not come back")
        row.notes.append("lmserve serve ran throughout" if alive else "lmserve serve stopped")
        if back is None or not alive:
            row.server_errors += 1
        return row
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
        out.close()
        err.close()


# --- 9. a soak -----------------------------------------------------------------------------------

def soak(stack: Stack, minutes: float, concurrency: int = 8, sample_every: float = 30.0) -> Row:
    """Steady traffic over every dialect, streamed and not, for ``minutes`` (a client told 429
    waits a second, as the SDKs back off); every process's resident memory sampled: after the
    first tenth (warm-up), it must stay within 5%."""
    row = Row(f"{minutes:g}-minute soak at concurrency {concurrency}", unavailable_ok=False)
    names = ["worker", "gateway0", "gateway1", "redis"]
    samples: dict[str, list[float]] = {name: [] for name in names}
    statuses: dict[int | None, int] = {}
    stop = threading.Event()
    client = httpx.Client(limits=httpx.Limits(max_connections=concurrency * 2))

    def load(n: int) -> None:
        i = n
        while not stop.is_set():
            path = (CHAT, RESPONSES, MESSAGES)[i % 3]
            body = json.loads(stream_body(path, tokens=32))
            body["stream"] = i % 2 == 0
            outcome = send(client, stack.url(i % 2), path, json.dumps(body).encode(), body["stream"])
            row.count(outcome)
            statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
            if outcome.status == 429:  # a full worker: back off as the SDKs do, then try again
                time.sleep(1.0)
            i += concurrency

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    ends = time.monotonic() + minutes * 60
    while time.monotonic() < ends:
        for name in names:
            samples[name].append(rss_mib(stack.procs[name].pid))
        time.sleep(min(sample_every, max(0.0, ends - time.monotonic())))
    stop.set()
    for thread in threads:
        thread.join(TIMEOUT + 10)
    settled = max(1, len(samples["worker"]) // 10)
    growth = []
    for name in names:
        base, peak = samples[name][settled], max(samples[name][settled:])
        growth.append(f"{name} {base:.0f}->{samples[name][-1]:.0f} MiB (peak {peak:.0f})")
        if peak > base * 1.05:
            row.breached += 1
    row.notes.append(", ".join(f"{n}x {s}" for s, n in sorted(statuses.items(), key=str)))
    row.notes.append("; ".join(growth))
    return row


# --- the table -----------------------------------------------------------------------------------

COLUMNS = ("scenario", "tries", "5xx", "hangs", "outside envelope", "cut, looked finished", "breached", "notes")


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row.scenario, row.tries, row.server_errors, row.hangs, row.outside_envelope,
                 row.cut_looking_finished, row.breached, "; ".join(row.notes)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF to serve (default: the default model)")
    parser.add_argument("--cases", type=int, default=2000, help="fuzzed requests (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="200 fuzz cases and a 1-minute soak, a smoke run")
    parser.add_argument("--soak-minutes", type=float, default=30.0, help="length of the soak (default 30)")
    args = parser.parse_args(argv)
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from shared.default_model import default_model_path
        args.model = str(default_model_path())
    cases = 200 if args.quick else args.cases
    with tempfile.TemporaryDirectory(prefix="lmserve-faults-") as tmp:
        stack = Stack(args.model, Path(tmp))
        rows: list[Row] = []
        try:
            for name, run in (("fuzz", lambda: fuzz(stack, cases, args.seed)),
                              ("kill worker", lambda: kill_scenario(stack, "worker")),
                              ("kill gateway", lambda: kill_scenario(stack, "gateway0")),
                              ("kill redis", lambda: kill_scenario(stack, "redis")),
                              ("big body", lambda: big_body(stack)),
                              ("slowloris", lambda: slowloris(stack)),
                              ("burst", lambda: burst(stack)),
                              ("outsider", lambda: outsider(stack)),
                              ("tampering redis", lambda: tampering(stack, "redis")),
                              ("tampering directory", lambda: tampering(stack, "directory")),
                              ("serve kill", lambda: serve_kill(args.model, Path(tmp))),
                              ("soak", lambda: soak(stack, 1.0 if args.quick else args.soak_minutes))):
                started = time.monotonic()
                rows.append(run())
                print(f"{name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        finally:
            stack.close()
    print(f"lscpu flags: {' '.join(sorted(cpu_flags()))}" if cpu_flags() else "")
    print(table(rows))
    return 0 if all(row.clean for row in rows) else 1


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return {f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))}
    except OSError:
        pass
    return set()


if __name__ == "__main__":
    sys.exit(main())
