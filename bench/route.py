"""KV-aware routing over several workers, against round-robin, and a worker killed mid-run.

    python -m bench.route [MODEL.gguf] [--conversations 8] [--turns 4] [--system-tokens 1000]

Real processes on loopback: Redis, two workers (each ``--batch 1 --kv-slots 4 --threads 1``, the
kvstore in Redis) and two gateways, all started afresh for each routing policy. The client is
the official openai SDK, streaming chat completions. The workload is Claude-Code-shaped: every
conversation has the same long system prompt, its own long first message (a file's worth,
~1,100 tokens), and each later turn appends the reply and a tool result (~270 tokens); the
conversations' turns are interleaved (round by round, two requests in flight), each sent to a
gateway drawn at random.

Printed per policy: the cached share of what each later turn's conversation had already been
through (the previous turn's prompt and reply), worst conversation and mean; time to first
token; how the requests spread; which routing rule chose (from the gateways' access logs).
Then, with prefix routing, worker 1 is killed with SIGKILL in the middle of round 2: what was
running on it ends with an error (the client retries it once, as Claude Code does), nothing
else fails, the survivor takes the load, and the restarted worker serves again.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from bench.faults import cpu_flags, free_port

REPO = Path(__file__).resolve().parent.parent
WORKER_HEADER = "x-lmserve-worker"
WORKER_FLAGS = ["--batch", "1", "--kv-slots", "4", "--threads", "1", "--queue", "8"]
VOCABULARY = ("alpha beta gamma delta epsilon function return value import module class method object "
              "string number list index error check test build file path line name type field").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


@dataclass
class Conversation:
    """One Claude-Code-shaped conversation: the shared system prompt, its own opening, then turns."""
    index: int
    messages: list[dict]
    rng: random.Random
    opening_words: int = 900  # a file's worth: ~1,100 tokens of its own
    result_words: int = 220  # a tool result per later turn: ~270 tokens

    def next_user(self, turn: int) -> dict:
        if turn == 1:
            return {"role": "user", "content": "Here is the file to review:\n" + _text(self.rng, self.opening_words)}
        return {"role": "user", "content": f"Tool result {turn}:\n" + _text(self.rng, self.result_words)}


@dataclass
class Result:
    conversation: int
    turn: int
    gateway: int
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0
    error: str = ""
    retried: bool = False
    cut_on: str = ""  # the worker whose reply failed on the first attempt ("" if none or unknown)


class Cluster:
    """Redis, two workers and two gateways on loopback, as separate processes."""

    def __init__(self, model: str | None, ctx: int, policy: str, redis_url: str, logs: Path, label: str = ""):
        self.model, self.ctx, self.policy, self.redis_url, self.logs = model, ctx, policy, redis_url, logs
        self.label = label or policy
        self.endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.workers: list[subprocess.Popen | None] = [None, None]
        for i in range(2):
            self.start_worker(i)
        self.ports = [free_port() for _ in range(2)]
        self.gateways = [self._spawn(f"gateway-{self.label}-{i}", [
            "gateway", "--worker", ",".join(self.endpoints), "--port", str(port), "--route", policy])
            for i, port in enumerate(self.ports)]
        self.wait_serving(2)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)

    def start_worker(self, i: int) -> None:
        self.workers[i] = self._spawn(f"worker-{self.label}-{i}", [
            "worker", *([self.model] if self.model else []), "--worker", self.endpoints[i], "--ctx", str(self.ctx),
            "--kv-store", self.redis_url, *WORKER_FLAGS])

    def routes(self) -> dict[str, int]:
        """How many requests each routing rule placed, from the gateways' access logs."""
        counts: dict[str, int] = {}
        for i in range(2):
            for line in (self.logs / f"gateway-{self.label}-{i}.log").read_text(errors="replace").splitlines():
                match = re.search(r"lmserve\.access .* route=(\S+)", line)
                if match and match.group(1) != "-":
                    counts[match.group(1)] = counts.get(match.group(1), 0) + 1
        return dict(sorted(counts.items()))

    def worker_id(self, i: int) -> str:
        return f"{socket.gethostname()}:{self.workers[i].pid}"

    def url(self, gateway: int) -> str:
        return f"http://127.0.0.1:{self.ports[gateway]}"

    def ready_workers(self, gateway: int) -> int:
        try:
            body = httpx.get(self.url(gateway) + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(w["ready"] for w in body.get("workers", []))

    def wait_serving(self, workers: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.ready_workers(g) >= workers for g in range(2)):
                time.sleep(1.5)  # a heartbeat or two: every gateway knows every worker's load
                return
            for proc in [*self.workers, *self.gateways]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"a process exited with {proc.returncode}; see {self.logs}")
            time.sleep(0.5)
        raise RuntimeError(f"the cluster did not get ready; see {self.logs}")

    def close(self) -> None:
        for proc in [*self.gateways, *self.workers]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.gateways, *self.workers]:
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


STREAMING: dict[str, int] = {}  # worker -> replies it is streaming now (for the kill run)
STREAMING_LOCK = threading.Lock()


def _streaming(worker: str, change: int) -> None:
    with STREAMING_LOCK:
        STREAMING[worker] = STREAMING.get(worker, 0) + change


def ask(cluster: Cluster, conversation: Conversation, turn: int, max_tokens: int) -> Result:
    """One turn, streamed; the reply joins the conversation. A reply cut by a dying worker is
    sent once more, as Claude Code does. The gateway is drawn at random (the same draw for
    every policy), as a proxy in front would spread the requests."""
    gateway = random.Random(conversation.index * 1000 + turn).randrange(2)
    result = Result(conversation.index, turn, gateway)
    for attempt in range(2):
        client = openai.OpenAI(base_url=cluster.url(gateway) + "/v1", api_key="x", max_retries=0, timeout=300)
        started = time.perf_counter()
        text, first = [], None
        try:
            stream = client.chat.completions.create(
                model="m", messages=conversation.messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            result.worker = stream.response.headers.get(WORKER_HEADER, "")
            try:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter()
                            _streaming(result.worker, +1)
                        text.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        result.prompt_tokens = chunk.usage.prompt_tokens
                        result.completion_tokens = chunk.usage.completion_tokens
                        details = chunk.usage.prompt_tokens_details
                        result.cached_tokens = details.cached_tokens if details else 0
            finally:
                if first is not None:
                    _streaming(result.worker, -1)
        except openai.APIError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            if attempt == 0:
                result.retried, result.cut_on = True, result.worker
            continue
        result.ttft = (first or time.perf_counter()) - started
        result.error = ""
        conversation.messages.append({"role": "assistant", "content": "".join(text)})
        return result
    return result


def run_rounds(cluster: Cluster, conversations: list[Conversation], turns: range, max_tokens: int,
               during: dict[int, callable] | None = None) -> list[Result]:
    """Round by round, every conversation's next turn, two in flight; ``during[t]`` runs while
    round t is under way."""
    results: list[Result] = []
    for turn in turns:
        for conversation in conversations:
            conversation.messages.append(conversation.next_user(turn))
        side = None
        if during and turn in during:
            side = threading.Thread(target=during[turn], daemon=True)
            side.start()
        with ThreadPoolExecutor(2) as pool:
            results += pool.map(lambda c: ask(cluster, c, turn, max_tokens), conversations)
        if side is not None:
            side.join()
    return results


def new_conversations(count: int, system_tokens: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    system = "You are a coding agent. Rules and tool documentation follow.\n" + _text(rng, int(system_tokens / 1.3))
    return [Conversation(i, [{"role": "system", "content": system}], random.Random(seed * 1000 + i))
            for i in range(count)]


@dataclass
class PolicyFigures:
    policy: str
    worst: float = 0.0  # lowest, over conversations, of its later turns' mean cached share
    mean: float = 0.0
    ttft_later: float = 0.0
    ttft_first: float = 0.0
    spread: dict[str, int] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    errors: int = 0


def figures(policy: str, results: list[Result]) -> PolicyFigures:
    out = PolicyFigures(policy)
    by_conversation: dict[int, list[float]] = {}
    previous: dict[int, int] = {}
    for r in sorted(results, key=lambda r: (r.conversation, r.turn)):
        if r.error:
            out.errors += 1
            continue
        if r.turn > 1 and r.conversation in previous:
            by_conversation.setdefault(r.conversation, []).append(r.cached_tokens / previous[r.conversation])
        # what the turn left in KV: its prompt and its reply
        previous[r.conversation] = r.prompt_tokens + r.completion_tokens
        out.spread[r.worker] = out.spread.get(r.worker, 0) + 1
    shares = [statistics.mean(v) for v in by_conversation.values()]
    out.worst, out.mean = min(shares), statistics.mean(shares)
    out.ttft_later = statistics.mean(r.ttft for r in results if r.turn > 1 and not r.error)
    out.ttft_first = statistics.mean(r.ttft for r in results if r.turn == 1 and not r.error)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.route", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args(argv)
    if shutil.which("redis-server") is None:
        parser.error("redis-server is not installed (Debian package redis-server)")
    logs = Path(tempfile.mkdtemp(prefix="lmserve-route-"))
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(logs)], stdout=subprocess.DEVNULL)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    rows: list[PolicyFigures] = []
    try:
        for seed, policy in enumerate(("prefix", "round-robin"), start=1):
            subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], capture_output=True)
            cluster = Cluster(args.model, args.ctx, policy, redis_url, logs)
            try:
                conversations = new_conversations(args.conversations, args.system_tokens, seed)
                started = time.monotonic()
                results = run_rounds(cluster, conversations, range(1, args.turns + 1), args.max_tokens)
                print(f"{policy}: {len(results)} requests in {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)
                names = {cluster.worker_id(i): f"worker {i}" for i in range(2)}
                row = figures(policy, results)
                row.spread = {names.get(k, k): v for k, v in sorted(row.spread.items())}
                row.routes = cluster.routes()
                rows.append(row)
            finally:
                cluster.close()
        subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], capture_output=True)
        kill = kill_run(args, redis_url, logs)
    finally:
        redis.terminate()
        redis.wait(10)

    print(f"lscpu flags: {' '.join(sorted(cpu_flags()))}")
    print(f"model: {args.model or 'default'}; 2 workers ({' '.join(WORKER_FLAGS)}, --ctx {args.ctx}, kvstore Redis), "
          f"2 gateways; {args.conversations} conversations x {args.turns} turns, shared system prompt "
          f"~{args.system_tokens} tokens, {args.max_tokens}-token replies, 2 requests in flight")
    print()
    print("| routing | turn 2+ cached / what the conversation had been through, worst conversation | mean "
          "| TTFT turn 1 | TTFT turns 2+ | requests per worker | chosen by | errors |")
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for row in rows:
        spread = ", ".join(f"{k}: {v}" for k, v in row.spread.items())
        routes = ", ".join(f"{k}: {v}" for k, v in row.routes.items())
        print(f"| {row.policy} | {row.worst:.1%} | {row.mean:.1%} | {row.ttft_first:.2f} s | {row.ttft_later:.2f} s "
              f"| {spread} | {routes} | {row.errors} |")
    prefix, rr = rows
    print(f"\nTTFT of turns 2+, round-robin / prefix: {rr.ttft_later / prefix.ttft_later:.2f}x")
    print(kill.report())
    ok = prefix.worst >= 0.9 and kill.clean
    print(f"logs: {logs}")
    return 0 if ok else 1


@dataclass
class KillFigures:
    killed_at: int = 0  # requests answered in round 2 when the SIGKILL went out
    cut: list[Result] = field(default_factory=list)  # failed first attempts on the killed worker
    failed_elsewhere: list[Result] = field(default_factory=list)
    failed_finally: list[Result] = field(default_factory=list)
    after_kill: dict[str, int] = field(default_factory=dict)  # round 2's answers, by worker
    rejoined: int = 0  # requests the restarted worker served in the rounds after it came back
    total: int = 0

    @property
    def clean(self) -> bool:
        return not self.failed_elsewhere and not self.failed_finally and self.rejoined > 0

    def report(self) -> str:
        return (f"kill -9 of worker 1 during round 2 (of {self.total} requests): {len(self.cut)} reply(ies) running "
                f"on it cut with an error and sent again by the client; {len(self.failed_elsewhere)} failure(s) "
                f"elsewhere; {len(self.failed_finally)} request(s) failed for good; round 2 answered by "
                f"worker: {self.after_kill}; the restarted worker served {self.rejoined} request(s) in the "
                f"later rounds")


def kill_run(args: argparse.Namespace, redis_url: str, logs: Path) -> KillFigures:
    cluster = Cluster(args.model, args.ctx, "prefix", redis_url, logs, label="kill")
    out = KillFigures()
    try:
        conversations = new_conversations(args.conversations, args.system_tokens, 3)
        victim = {"id": cluster.worker_id(1)}
        results = run_rounds(cluster, conversations, range(1, 2), args.max_tokens)

        def kill_when_under_way() -> None:
            """SIGKILL worker 1 while it is streaming a reply."""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not STREAMING.get(victim["id"]):
                time.sleep(0.005)
            os.kill(cluster.workers[1].pid, signal.SIGKILL)
            cluster.workers[1].wait(10)

        results += run_rounds(cluster, conversations, range(2, 3), args.max_tokens, {2: kill_when_under_way})
        for r in results:
            if r.retried and r.cut_on == victim["id"]:
                out.cut.append(r)
            elif r.retried:
                out.failed_elsewhere.append(r)
            if r.error:
                out.failed_finally.append(r)
            elif r.turn == 2:
                out.after_kill[r.worker] = out.after_kill.get(r.worker, 0) + 1
        cluster.start_worker(1)
        cluster.wait_serving(2)
        restarted = cluster.worker_id(1)
        later = run_rounds(cluster, conversations, range(3, args.turns + 1), args.max_tokens)
        out.failed_finally += [r for r in later if r.error]
        out.rejoined = sum(r.worker == restarted for r in later)
        names = {cluster.worker_id(0): "worker 0", victim["id"]: "worker 1 (killed)"}
        out.after_kill = {names.get(k, k): v for k, v in out.after_kill.items()}
        out.total = len(results) + len(later)
    finally:
        cluster.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
