"""The stack under bad input and faults: one table of what went wrong, which should be nothing.

    python -m bench.faults [--cases 2000] [--model MODEL.gguf] [--quick]

Starts a stack of real processes on loopback: redis-server, one worker (``--kv-store`` on that
Redis, ``--batch 4 --queue 4``) and two gateways (``--header-timeout 2``), then runs:

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

Columns: tries, 5xx, hangs (no reply within 120 s), replies outside the dialect's envelope,
streams that ended looking finished though they were cut, and notes. Exit status 1 when any
count that should be zero is not.
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120.0
CHAT, RESPONSES, MESSAGES, COUNT = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
ENDPOINTS = (CHAT, RESPONSES, MESSAGES, COUNT)
NO_END = {"0": -100, "2": -100}  # SmolLM2's end-of-turn ids, for streams that must keep going


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

    def __init__(self, model: str, workdir: Path):
        self.workdir = workdir
        self.redis_port = free_port()
        self.worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.gateway_ports = [free_port(), free_port()]
        py = [sys.executable, "-m", "launcher.cli"]
        self.commands = {
            "redis": ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(workdir)],
            "worker": [*py, "worker", model, "--worker", self.worker_endpoint, "--ctx", "2048", "--batch", "4",
                       "--kv-slots", "4", "--queue", "4", "--kv-store", f"redis://127.0.0.1:{self.redis_port}/0"],
            **{f"gateway{i}": [*py, "gateway", "--worker", self.worker_endpoint, "--port", str(port),
                               "--header-timeout", "2"] for i, port in enumerate(self.gateway_ports)},
        }
        self.procs: dict[str, subprocess.Popen] = {}
        for name in self.commands:
            self.start(name)
        self.wait_ready()

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[i]}"

    def start(self, name: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(self.commands[name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

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
        return not (self.server_errors or self.hangs or self.outside_envelope or self.cut_looking_finished)


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


# --- the table -----------------------------------------------------------------------------------

COLUMNS = ("scenario", "tries", "5xx", "hangs", "outside envelope", "cut, looked finished", "notes")


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row.scenario, row.tries, row.server_errors, row.hangs, row.outside_envelope,
                 row.cut_looking_finished, "; ".join(row.notes)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF to serve (default: the default model)")
    parser.add_argument("--cases", type=int, default=2000, help="fuzzed requests (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="200 fuzz cases, a smoke run")
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
                              ("burst", lambda: burst(stack))):
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
