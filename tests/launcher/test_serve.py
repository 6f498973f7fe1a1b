"""``lmserve serve``: the one-command stack answers the reference README's curl examples."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
import time

import re

import httpx
import psutil
from conftest import wait_until
import pytest
from conftest import REPO, free_port

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.faults import wire_outsider  # noqa: E402  (the raw peer of the fault bench, one copy)


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--port", str(port)],
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


# --- the stack's life cycle: progress, readiness, shutdown, dying children ------------------

class Served:
    """``lmserve serve`` as a child, its stdout and stderr collected as they come (stderr on a
    pseudo-terminal when ``tty``, so the progress bar is drawn)."""

    def __init__(self, *flags: str, tty: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout: list[str] = []
        self.stderr = bytearray()
        err_read, err_write = pty.openpty() if tty else os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--port", str(self.port), *flags],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=err_write, text=True)
        os.close(err_write)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(err_read,), daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)

    def _read_stderr(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty reports EIO once every writer has gone
                chunk = b""
            if not chunk:
                os.close(fd)
                return
            self.stderr += chunk

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any("ready on" in line for line in self.stdout):
            assert self.proc.poll() is None, f"lmserve serve exited:\n{self.stderr.decode(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, "lmserve serve did not get ready"
            time.sleep(0.1)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def role_pids(self, role: str) -> set[int]:
        """The living children of a role (one just killed may linger as a zombie until reaped)."""
        pids = set()
        for child in self.children():
            try:
                if role in child.cmdline()[3:5]:
                    pids.add(child.pid)
            except psutil.Error:
                continue
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_factory():
    started: list[Served] = []

    def start(*flags: str, tty: bool = False) -> Served:
        served = Served(*flags, tty=tty)
        started.append(served)
        return served

    yield start
    for served in started:
        leftovers = served.children() if served.proc.poll() is None else []
        served.stop()
        for child in leftovers:  # never leave a stack behind, whatever the test did
            if child.is_running():
                child.kill()


def test_two_gateways_a_progress_bar_and_a_drained_shutdown(serve_factory, default_model):
    served = serve_factory("--gateways", "2", "--drain-timeout", "120", tty=True)
    served.wait_ready()
    stderr = served.stderr.decode(errors="replace")
    assert "loading SmolLM2" in stderr and "100%" in stderr and "#" * 30 in stderr  # the bar, drawn full
    assert f"ready on {served.url} (2 gateways" in "".join(served.stdout)

    # both gateway processes share the port and name themselves in every answer
    gateways = served.role_pids("gateway")
    assert len(gateways) == 2
    answered: set[int] = set()
    for _ in range(200):
        response = httpx.get(served.url + "/health", timeout=10)
        assert response.status_code == 200
        answered.add(int(response.headers["x-lmserve-gateway"].rsplit(":", 1)[1]))
        if answered == gateways:
            break
    assert answered == gateways

    # the two share their metrics: each one scraped answers with the count of both
    for _ in range(4):
        assert httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).status_code == 200
    scraped = {}
    for _ in range(200):
        response = httpx.get(served.url + "/metrics", timeout=10)
        requests = sum(float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
                       if line.startswith("lmserve_requests_total{"))
        scraped[int(response.headers["x-lmserve-gateway"].rsplit(":", 1)[1])] = requests
        if set(scraped) == gateways:
            break
    assert scraped == dict.fromkeys(gateways, 4.0)

    # Ctrl-C while a stream is in flight: the stream still ends properly, then everything stops
    children = served.children()
    body = {"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 24,
            "stream": True, "logit_bias": {"0": -100, "2": -100}}  # no early end-of-turn
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        while '"content":"' not in (line := next(lines)) or '"content":""' in line:
            pass  # wait for the first generated token
        served.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2] or '"finish_reason":"length"' in rest[-3]
    assert served.proc.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned: {alive}"


def test_two_workers_behind_two_gateways(serve_factory, default_model):
    served = serve_factory("--workers", "2", "--gateways", "2")
    served.wait_ready()
    assert f"ready on {served.url} (2 gateways, 2 workers tcp://127.0.0.1:" in "".join(served.stdout)
    workers = served.role_pids("worker")
    assert len(workers) == 2 and len(served.role_pids("gateway")) == 2
    # every gateway comes to know both workers (a gateway may be ready with one before it has
    # the other's card): polls land on either gateway, and twenty in a row must count two
    streak = [0]

    def settled() -> bool:
        health = httpx.get(served.url + "/health", timeout=10).json()
        streak[0] = streak[0] + 1 if sum(w["ready"] for w in health["workers"]) == 2 else 0
        return streak[0] >= 20

    assert wait_until(settled, timeout=60, interval=0.05)
    # each worker was given its share of the two cores
    assert all("--threads" in p.cmdline() and p.cmdline()[p.cmdline().index("--threads") + 1] == str(
        max(1, len(os.sched_getaffinity(0)) // 2)) for p in served.children() if p.pid in workers)

    def ask(i: int) -> int:
        response = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": f"You are assistant number {i}."},
                         {"role": "user", "content": "Say hello."}], "max_tokens": 16})
        assert response.status_code == 200
        return int(response.headers["x-lmserve-worker"].rsplit(":", 1)[1])

    # new conversations spread: each gateway sends its next one to the worker with fewer of them
    # (the kernel may hand the requests to either gateway; one of the two gets at least two)
    served_by = {ask(i) for i in range(4)}
    assert served_by == workers
    children = served.children()
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphaned: {alive}"


def test_a_killed_worker_or_gateway_is_restarted_while_the_others_serve(serve_factory, default_model):
    served = serve_factory("--workers", "2", "--api-key", "the-key")
    served.wait_ready()
    key = {"Authorization": "Bearer the-key"}
    # /health without the key says ready, and nothing about workers, endpoints or hosts
    assert httpx.get(served.url + "/health", timeout=10).json() == {"status": "ok"}
    assert len(httpx.get(served.url + "/health", headers=key, timeout=10).json()["workers"]) == 2
    # the workers' wire answers no one but the stack's own gateway
    endpoints = re.search(r"2 workers (\S+)\)", "".join(served.stdout)).group(1).split(",")
    assert len(endpoints) == 2 and all(wire_outsider(e, None) is None for e in endpoints)

    def ask() -> int:
        response = httpx.post(served.url + "/v1/chat/completions", headers=key, timeout=120, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
        return response.status_code

    victim = min(served.role_pids("worker"))
    os.kill(victim, signal.SIGKILL)
    statuses = [ask() for _ in range(6)]  # meanwhile, the other worker serves every request
    assert statuses == [200] * 6
    assert wait_until(lambda: b"is back" in served.stderr, timeout=120)
    stderr = served.stderr.decode()
    assert re.search(rf"worker \d \(pid {victim}\) was killed by SIGKILL; the others go on, restarting it", stderr)
    workers = served.role_pids("worker")
    assert len(workers) == 2 and victim not in workers

    def both_ready() -> bool:
        health = httpx.get(served.url + "/health", headers=key, timeout=10).json()
        return sum(w["ready"] for w in health["workers"]) == 2
    assert wait_until(both_ready, timeout=60)

    (gateway,) = served.role_pids("gateway")
    os.kill(gateway, signal.SIGKILL)
    assert wait_until(lambda: served.role_pids("gateway") - {gateway}, timeout=30)

    def answering() -> bool:
        try:
            return ask() == 200
        except httpx.HTTPError:
            return False
    assert wait_until(answering, timeout=60)
    assert served.proc.poll() is None  # the command itself went on throughout


def test_children_do_not_outlive_a_killed_parent(serve_factory, default_model):
    served = serve_factory()
    served.wait_ready()
    children = served.children()
    assert len(children) == 2
    served.proc.kill()  # no chance to clean up: the children must notice by themselves
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphaned: {alive}"


def test_a_model_that_cannot_load_ends_the_command_with_the_reason(serve_factory, tmp_path):
    served = serve_factory(str(tmp_path / "missing.gguf"))
    assert served.proc.wait(60) == 2
    time.sleep(0.2)  # the reader thread drains the last bytes
    stderr = served.stderr.decode()
    assert "model file not found" in stderr
    assert "the worker (pid" in stderr and "exited with code 2 while loading the model" in stderr


def test_two_workers_on_their_defaults_keep_six_conversations_resident(serve_factory, tmp_path):
    """Agents run several conversations at once (a main one and its subagents): each worker
    sizes its KV slots from its memory by default (at least four), so with two workers and six
    interleaved conversations every second turn finds its first turn still resident."""
    import random

    import openai

    served = serve_factory("--workers", "2", "--kv-cache-dir", str(tmp_path / "kv"))
    served.wait_ready()
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
    words = ("notes", "river", "stone", "lamp", "garden", "window", "paper", "cloud", "engine", "bridge")
    conversations = []
    for i in range(6):
        rng = random.Random(i)
        system = f"You are assistant {i}. Reference: " + " ".join(rng.choice(words) for _ in range(400))
        conversations.append([{"role": "system", "content": system},
                              {"role": "user", "content": f"Name the first word of the reference, {i}."}])
    firsts = []
    for messages in conversations:
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "And the second word?"})
        firsts.append(reply.usage.prompt_tokens)
    for messages, first in zip(conversations, firsts):
        usage = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0).usage
        assert usage.prompt_tokens_details.cached_tokens >= 0.95 * first, (usage, first)
    log = served.stderr.decode(errors="replace")
    assert "--kv-slots" in log and "resident caches" in log  # each worker says how many it chose
    assert "--kv-budget" in log  # and how much KV its idle conversations may hold


def test_sighup_rereads_the_keys_file_in_every_gateway_and_the_stack_serves_on(serve_factory, default_model,
                                                                                tmp_path):
    """With --api-keys-file, SIGHUP to ``lmserve serve`` is a reload, as for a daemon: each
    gateway reads the file again, and nothing stops."""
    keys = tmp_path / "keys"
    keys.write_text("alice:alice-key\n", encoding="utf-8")
    served = serve_factory("--gateways", "2", "--api-keys-file", str(keys))
    served.wait_ready()
    gateways = served.role_pids("gateway")
    assert len(gateways) == 2

    def status(key: str) -> int:
        return httpx.get(served.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

    assert status("alice-key") == 200 and status("bob-key") == 401
    keys.write_text("bob:bob-key\n", encoding="utf-8")
    served.proc.send_signal(signal.SIGHUP)
    # new connections spread over both gateways: twenty in a row all see the new file
    assert wait_until(lambda: all(status("bob-key") == 200 for _ in range(20)), timeout=30)
    assert all(status("alice-key") == 401 for _ in range(10))
    assert served.proc.poll() is None and served.role_pids("gateway") == gateways  # the same processes
