"""Several workers behind the gateways, run for real: Redis, two workers of the default model and
two gateways on loopback ports, each gateway given both workers.

What must hold: a conversation's later turns go to the worker holding its prefix, through
either gateway; concurrent conversations spread over the workers; a full worker is skipped and
429 comes only when all are full; a worker killed with SIGKILL costs only the replies it was
producing (a request queued there is served by the other), and it rejoins when it returns; a
fresh worker warms from the kvstore.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest
from access_logs import access_entries
from conftest import GatewayProcess, WorkerProcess, wait_until

WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lantern meadow nickel "
         "orchid pepper quartz raven saffron timber umber velvet willow xenon yarrow zephyr").split()
WORKER_HEADER = "x-lmserve-worker"


def system_prompt(seed: int, words: int) -> str:
    """A long system prompt of its own for each conversation (a Claude Code turn's is ~16k tokens)."""
    rng = random.Random(seed)
    return "You are a careful assistant. Reference notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Pool:
    redis: object
    workers: list[WorkerProcess]
    gateways: list[GatewayProcess]

    def client(self, gateway: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[gateway].url + "/v1", api_key="x", max_retries=0, timeout=180)

    def worker_ids(self) -> dict[str, WorkerProcess]:
        """host:pid, as the gateways name a worker, for each worker process."""
        return {f"{socket.gethostname()}:{w.proc.pid}": w for w in self.workers}

    def health(self, gateway: int) -> dict:
        return httpx.get(self.gateways[gateway].url + "/health", timeout=5).json()


WORKER_FLAGS = ("--ctx", "2048", "--batch", "1", "--kv-slots", "4", "--queue", "1", "--threads", "1")


@pytest.fixture(scope="module")
def pool(start_redis, start_worker, start_gateway, default_model):
    redis = start_redis()
    workers = [start_worker(default_model, *WORKER_FLAGS, "--kv-store", redis.url) for _ in range(2)]
    both = SimpleNamespace(endpoint=",".join(w.endpoint for w in workers))
    # a request queued ahead costs 256 prompt tokens: the held prefixes here (~900 tokens) pay for one
    gateways = [start_gateway(both, "--log-format", "json", "--route-queue-tokens", "256", wait=False)
                for _ in range(2)]
    for gateway in gateways:
        gateway.wait_ready()
    top = Pool(redis, workers, gateways)
    # each gateway has heard both workers' first heartbeats
    assert wait_until(lambda: all(sum(w["ready"] for w in top.health(g)["workers"]) == 2 for g in (0, 1)), 30)
    yield top


def chat(top: Pool, messages: list[dict], gateway: int = 0, max_tokens: int = 8, **extra) -> tuple[str, str, object]:
    """(worker that served it, reply text, usage) of a whole chat completion."""
    raw = top.client(gateway).chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    answer = raw.parse()
    return raw.headers[WORKER_HEADER], answer.choices[0].message.content or "", answer.usage


def heard_since(top: Pool, worker_id: str, since: float) -> bool:
    """Whether both gateways have heard from the worker after ``since`` (``time.monotonic()``,
    one clock for every process here). Once its last reply has ended, what they hear is its next
    heartbeat, which says what it holds and runs now."""
    for gateway in (0, 1):
        elapsed = time.monotonic() - since  # read before /health: the gateway's clock is later still
        described = [w for w in top.health(gateway)["workers"] if w["worker"] == worker_id]
        # last_heard_s is rounded to a tenth
        if not described or described[0]["last_heard_s"] is None or described[0]["last_heard_s"] + 0.1 >= elapsed:
            return False
    return True


def entries(top: Pool, gateway: int) -> list[dict]:
    return access_entries(top.gateways[gateway].log_path, dialects_only=True)


def entry_after(top: Pool, gateway: int, seen: int) -> dict:
    """The access-log entry of a request answered after ``seen`` entries (written as its reply ends)."""
    assert wait_until(lambda: len(entries(top, gateway)) > seen, 10)
    return entries(top, gateway)[seen]


def test_a_conversations_turns_follow_its_prefix_through_either_gateway(pool):
    messages = [{"role": "system", "content": system_prompt(1, 500)},
                {"role": "user", "content": "Which word comes first in the notes?"}]
    first_worker, reply, first_usage = chat(pool, messages, gateway=0)
    replied = time.monotonic()
    assert first_worker in pool.worker_ids()
    for turn, gateway in ((2, 1), (3, 0), (4, 1)):
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"And word number {turn}?"}]
        # the heartbeat after the last reply tells both gateways what that worker now holds
        assert wait_until(lambda since=replied: heard_since(pool, first_worker, since), 10)
        seen = len(entries(pool, gateway))
        worker, reply, usage = chat(pool, messages, gateway=gateway)
        replied = time.monotonic()
        entry = entry_after(pool, gateway, seen)
        assert worker == first_worker and entry["worker"] == first_worker
        assert entry["route"] == "prefix", entry
        # the whole previous prompt was held; only the new turn was computed
        assert usage.prompt_tokens_details.cached_tokens >= 0.9 * first_usage.prompt_tokens
        first_usage = usage


def test_concurrent_conversations_spread_over_the_workers(pool):
    conversations = [[{"role": "system", "content": system_prompt(100 + i, 200)},
                      {"role": "user", "content": "Summarise the notes in five words."}] for i in range(4)]
    seen = len(entries(pool, 0))
    with ThreadPoolExecutor(4) as threads:
        served = list(threads.map(lambda m: chat(pool, m, max_tokens=24)[0], conversations))
    assert set(served) == set(pool.worker_ids()), served
    assert wait_until(lambda: len(entries(pool, 0)) == seen + 4, 10)
    routes = [e["route"] for e in entries(pool, 0)[seen:]]
    assert "load" in routes and set(routes) <= {"hash", "load"}, routes


def _long_stream(top: Pool, messages: list[dict], gateway: int, outcome: dict, tokens: int = 400) -> None:
    """A reply long enough to hold its worker; what happened is left in ``outcome``."""
    try:
        stream = top.client(gateway).chat.completions.create(
            model="m", messages=messages, max_tokens=tokens, stream=True, extra_body={"ignore_eos": True})
        outcome["worker"] = stream.response.headers[WORKER_HEADER]
        outcome["text"] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    except openai.APIError as exc:
        outcome["error"] = exc
    except Exception as exc:  # noqa: BLE001 - the test reads it
        outcome["error"] = exc


def _start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _busy(top: Pool, worker_id: str, running: int, waiting: int = 0, gateway: int = 0) -> bool:
    """Whether the worker's last heartbeat, as the gateway heard it, counts at least so many."""
    for w in top.health(gateway)["workers"]:
        if w["worker"] == worker_id:
            return w["running"] >= running and w["waiting"] >= waiting
    return False


def _idle(top: Pool, worker_id: str) -> bool:
    return not _busy(top, worker_id, 1) and not _busy(top, worker_id, 0, 1)


def test_a_full_worker_is_skipped_and_429_only_when_all_are_full(pool):
    ids = list(pool.worker_ids())
    outcomes = [{} for _ in range(4)]
    longs = [[{"role": "system", "content": system_prompt(200 + i, 300)},
              {"role": "user", "content": "Write a long story."}] for i in range(4)]
    threads = []
    # from an idle pool: a reply an earlier test left running would make both workers look
    # alike to the second request here
    assert wait_until(lambda: all(_idle(pool, w) for w in ids), 60)
    # one long reply on each worker (the second goes to the less loaded one)
    for i in range(2):
        threads.append(_start(_long_stream, pool, longs[i], 0, outcomes[i]))
        assert wait_until(lambda: "worker" in outcomes[i], 60)
        assert wait_until(lambda: _busy(pool, outcomes[i]["worker"], 1), 30)
    assert {outcomes[0]["worker"], outcomes[1]["worker"]} == set(ids)
    # then one more waits on each (--queue 1), the second once the first is seen waiting: both
    # workers are now full
    for queued, i in enumerate((2, 3), start=1):
        threads.append(_start(_long_stream, pool, longs[i], 0, outcomes[i], 4))
        assert wait_until(lambda count=queued: sum(_busy(pool, w, 1, 1) for w in ids) == count, 30)
    # both gateways see it, so the one asked next skips both rather than trying one
    assert wait_until(lambda: all(_busy(pool, w, 1, 1, gateway=g) for w in ids for g in (0, 1)), 30)
    with pytest.raises(openai.RateLimitError) as refused:
        chat(pool, [{"role": "user", "content": "Anyone free?"}], gateway=1)
    assert "full" in str(refused.value)
    for thread in threads:
        thread.join(180)
    assert all("text" in o for o in outcomes), outcomes
    # a conversation's worker filled up: its next turn goes to the free one, not into a 429
    held = longs[0]
    full = outcomes[0]["worker"]
    # a heartbeat from after those replies: what the gateway counts next is the new reply alone
    assert wait_until(lambda: _idle(pool, full), 30)
    threads = [_start(_long_stream, pool, held, 0, outcomes[0])]  # by its prefix, to the same worker
    assert wait_until(lambda: _busy(pool, full, 1), 60)
    threads.append(_start(_long_stream, pool, held, 0, outcomes[1], 4))  # waits there: worth its prefix
    assert wait_until(lambda: all(_busy(pool, full, 1, 1, gateway=g) for g in (0, 1)), 30)
    worker, text, _ = chat(pool, held, gateway=1)
    assert worker != full and text
    assert outcomes[0]["worker"] == outcomes[1]["worker"] == full
    for thread in threads:
        thread.join(180)


def test_a_killed_worker_costs_only_its_running_replies_and_rejoins(pool):
    held = [{"role": "system", "content": system_prompt(300, 600)},
            {"role": "user", "content": "Which word comes first in the notes?"}]
    victim_id, reply, _ = chat(pool, held)
    replied = time.monotonic()
    victim = pool.worker_ids()[victim_id]
    survivor_id = next(w for w in pool.worker_ids() if w != victim_id)
    held += [{"role": "assistant", "content": reply}]
    # the gateways hear what the victim holds, and that it runs nothing now
    assert wait_until(lambda: heard_since(pool, victim_id, replied), 10)
    # a long reply of the conversation runs on the victim, by its prefix
    running = {}
    stream_thread = _start(_long_stream, pool, held + [{"role": "user", "content": "Write a long story."}],
                           0, running)
    assert wait_until(lambda: "worker" in running, 60)
    assert running["worker"] == victim_id
    assert wait_until(lambda: _busy(pool, victim_id, 1), 30)
    # another turn of it waits there: its prefix pays for the wait
    queued = {}
    seen = len(entries(pool, 1))
    queued_thread = _start(_long_stream, pool, held + [{"role": "user", "content": "And the second word?"}],
                           1, queued, 6)
    assert wait_until(lambda: _busy(pool, victim_id, 1, 1), 30)
    victim.proc.send_signal(signal.SIGKILL)
    stream_thread.join(60)
    queued_thread.join(120)
    assert "error" in running and "text" not in running, running  # its running reply ends in an error event
    assert queued.get("text"), queued  # the one it had not started is served by the survivor, unseen
    entry = entry_after(pool, 1, seen)
    assert entry["worker"] == survivor_id and entry["status"] == 200, entry
    # requests go on, on the survivor
    assert wait_until(lambda: sum(w["ready"] for w in pool.health(0)["workers"]) == 1, 10)
    worker, text, _ = chat(pool, [{"role": "user", "content": "Say hello."}], gateway=0)
    assert worker == survivor_id and text
    # the victim comes back on its endpoint; both gateways find it by themselves and route to it
    assert victim.proc.wait(10) == -signal.SIGKILL
    victim.start()
    victim.wait_ready()
    assert wait_until(lambda: all(sum(w["ready"] for w in pool.health(g)["workers"]) == 2 for g in (0, 1)), 30)
    conversations = [[{"role": "system", "content": system_prompt(400 + i, 100)},
                      {"role": "user", "content": "Say hello."}] for i in range(2)]
    with ThreadPoolExecutor(2) as threads:
        served = {w for w, _, _ in threads.map(lambda m: chat(pool, m, max_tokens=24), conversations)}
    assert served == set(pool.worker_ids()), served


def test_a_fresh_worker_warms_from_the_kvstore(pool):
    messages = [{"role": "system", "content": system_prompt(500, 700)},
                {"role": "user", "content": "Which word comes last in the notes?"}]
    _, reply, first = chat(pool, messages)
    # both workers restart: a stopped worker spills what its slots hold to Redis on its way out
    for worker in pool.workers:
        worker.stop()
    for worker in pool.workers:
        worker.start()
    for worker in pool.workers:
        worker.wait_ready()
    assert wait_until(lambda: all(sum(w["ready"] for w in pool.health(g)["workers"]) == 2 for g in (0, 1)), 30)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the first?"}]
    seen = len(entries(pool, 1))
    _, _, usage = chat(pool, messages, gateway=1)
    # no worker holds it resident: whichever took it restored the spilled chunks (256 tokens each)
    assert entry_after(pool, 1, seen)["route"] in ("hash", "load")
    assert usage.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 256


def test_a_gateway_finds_workers_by_name(pool, start_gateway):
    port = pool.workers[0].endpoint.rsplit(":", 1)[1]
    named = start_gateway(SimpleNamespace(endpoint=f"dns+tcp://localhost:{port}"), "--log-format", "json")
    health = httpx.get(named.url + "/health", timeout=5).json()
    assert [w["endpoint"] for w in health["workers"] if w["ready"]] == [f"tcp://127.0.0.1:{port}"]
    client = openai.OpenAI(base_url=named.url + "/v1", api_key="x", max_retries=0, timeout=120)
    answer = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert answer.headers[WORKER_HEADER] == f"{socket.gethostname()}:{pool.workers[0].proc.pid}"
    named.stop()
