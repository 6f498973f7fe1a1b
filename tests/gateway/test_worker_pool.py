"""The routing choice of ``gateway.worker_pool`` on its own: real ``WorkerClient`` objects given
model cards and heartbeat values by hand, no worker behind them. The end-to-end behaviour with
real workers is in tests/deploy/test_scale_out.py."""

from __future__ import annotations

import asyncio

import pytest

from gateway.neutral import NeutralRequest
from gateway.worker_client import WorkerClient
from gateway.flags import DEFAULT_QUEUE_TOKENS
from gateway.worker_pool import QueueCost, WorkerPool, affinity_key, parse_endpoints, resolve
from shared.prefix_digest import ROUTE_BLOCK, held_prefix, prefix_digests
from shared.protocol import DEFAULT_ENDPOINT, PROTOCOL_VERSION, Capabilities, Heartbeat, ModelCard, Tags

PROMPT = list(range(1000, 1000 + 40 * ROUTE_BLOCK + 7))


def card(instance: str, fingerprint: str = "fp", batch: int = 1, queue: int = 2) -> ModelCard:
    return ModelCard(PROTOCOL_VERSION, "m", "llama", 4096, 50000, {}, None, fingerprint,
                     Capabilities(4096, Tags("<think>", "</think>"), batch=batch, queue=queue,
                                  worker=f"host:{instance}"), instance=instance)


def pool_of(*cards: ModelCard, **options) -> WorkerPool:
    """A pool whose clients have heard these cards (and no heartbeat yet)."""
    endpoints = ",".join(f"tcp://127.0.0.1:{9000 + i}" for i in range(len(cards)))
    pool = WorkerPool(endpoints, 1.0, 6.0, **{"queue_tokens": 1024, **options})
    for i, each in enumerate(cards):
        client = WorkerClient(f"tcp://127.0.0.1:{9000 + i}")
        client.receive(each)
        pool.clients[client.endpoint] = client
    return pool


def beat(client, waiting: int = 0, running: int = 0, holds: list[int] | None = None) -> None:
    """A worker's heartbeat, taken in as the client takes one off the wire."""
    client.receive(Heartbeat(0.0, client.card.instance, waiting, running, prefixes=prefix_digests(holds or [])))


def test_digests_chain_the_whole_prefix():
    digests = prefix_digests(PROMPT)
    assert len(digests) == len(PROMPT) // ROUTE_BLOCK
    assert prefix_digests(PROMPT[:3 * ROUTE_BLOCK]) == digests[:3]
    changed = prefix_digests([7] + PROMPT[1:])
    assert not set(changed) & set(digests)  # one early token changes every later block
    held = frozenset(prefix_digests(PROMPT[:4 * ROUTE_BLOCK + 5]))
    assert held_prefix(digests, held) == 4 * ROUTE_BLOCK


def test_the_worker_holding_more_of_the_prompt_wins():
    pool = pool_of(card("a"), card("b"))
    a, b = pool.clients.values()
    beat(a, holds=PROMPT[:2 * ROUTE_BLOCK])
    beat(b, holds=PROMPT[:6 * ROUTE_BLOCK])
    assert pool.choose(PROMPT, "conv") == (b, "prefix")
    # busier, but its prefix saves more than the wait costs (1024 tokens a batch place here)
    beat(a)
    beat(b, running=1, holds=PROMPT)
    assert pool.choose(PROMPT, "conv") == (b, "prefix")
    # ... until too much is queued there
    b.card.capabilities.queue = 4
    beat(b, waiting=2, running=1, holds=PROMPT)
    assert pool.choose(PROMPT, "conv") == (a, "load")


def test_a_worker_with_a_free_batch_place_costs_no_wait():
    pool = pool_of(card("a", batch=4, queue=8), card("b", batch=4, queue=8))
    a, b = pool.clients.values()
    beat(a, running=3, holds=PROMPT[:ROUTE_BLOCK])
    beat(b, running=1)
    assert pool.choose(PROMPT, "conv") == (a, "prefix")  # starts at once there, sharing its steps
    beat(a, waiting=2, running=4, holds=PROMPT[:ROUTE_BLOCK])
    assert pool.choose(PROMPT, "conv") == (b, "load")


def test_the_cost_of_waiting_is_measured():
    cost = QueueCost()
    assert cost.tokens == DEFAULT_QUEUE_TOKENS  # nothing measured yet
    cost.observe(computed=1000, first_token_after=2.0, ended_after=3.0)  # 500 tokens/s, 3 s a request
    assert cost.tokens == pytest.approx(1500)
    cost.observe(computed=10, first_token_after=0.5, ended_after=3.0)  # too few computed to tell a rate
    assert cost.rate == pytest.approx(500)
    assert QueueCost(fixed=300).tokens == 300


def test_a_prefix_every_conversation_shares_does_not_pull_new_ones():
    pool = pool_of(card("a"), card("b"))
    a, b = pool.clients.values()
    system = list(range(5000, 5000 + 10 * ROUTE_BLOCK))  # the system prompt and tools of every conversation
    first, second = system + PROMPT, system + [7] + PROMPT
    assert pool.choose(first, "first")[0] is not None
    pool.conversations.settle("first", a.endpoint)
    beat(a, holds=first)  # the first conversation ran on a: a holds the shared part too
    beat(b)
    # the second conversation's blocks past the shared part are its own: none is held anywhere,
    # and a holding the shared part is no reason to pile onto it
    assert pool.choose(second, "second") == (b, "load")
    assert pool.conversations.shared_prefix(prefix_digests(second), "second") == len(system)
    # the first conversation's next turn still finds its own prefix on a
    beat(b, holds=second)
    assert pool.choose(first + [1, 2, 3], "first") == (a, "prefix")


def test_new_conversations_spread_and_come_home():
    pool = pool_of(card("a"), card("b"), card("c"))
    placed = {i: pool.choose(PROMPT, f"conversation {i}") for i in range(30)}
    assert placed[0][1] == "hash" and {route for _, route in list(placed.values())[1:]} <= {"load", "hash"}
    counts = {}
    for client, _ in placed.values():
        counts[client] = counts.get(client, 0) + 1
    assert sorted(counts.values()) == [10, 10, 10]  # the fewest conversations at home take the next
    for i in range(30):  # evicted everywhere: each goes back to its home
        assert pool.choose(PROMPT, f"conversation {i}") == (placed[i][0], "hash")


def test_removing_a_worker_moves_only_its_own_conversations():
    pool = pool_of(card("a"), card("b"), card("c"))
    before = {i: pool.choose(PROMPT, f"k{i}")[0] for i in range(30)}
    gone = next(iter(pool.clients.values()))
    after = {i: pool.choose(PROMPT, f"k{i}", skip={gone})[0] for i in range(30)}
    assert all(after[i] is before[i] for i in before if before[i] is not gone)
    assert all(after[i] is not gone for i in after)


def test_without_an_affinity_key_load_decides_and_ties_rotate():
    pool = pool_of(card("a"), card("b"))
    a, b = pool.clients.values()
    beat(a, running=1)
    assert pool.choose(PROMPT[:10], None) == (b, "load")
    beat(a)
    assert {pool.choose(PROMPT[:10], None)[0] for _ in range(4)} == {a, b}


def test_a_full_worker_is_skipped_and_none_is_left_when_all_are():
    pool = pool_of(card("a", queue=1), card("b", queue=1))
    a, b = pool.clients.values()
    beat(a, waiting=1, running=1, holds=PROMPT)  # holds the whole prompt, but would answer BUSY
    assert pool.choose(PROMPT, "conv")[0] is b
    beat(b, waiting=1, running=1)
    assert pool.choose(PROMPT, "conv") is None


def test_round_robin_takes_turns():
    pool = pool_of(card("a"), card("b"), policy="round-robin")
    a, b = pool.clients.values()
    beat(a, holds=PROMPT)
    assert [pool.choose(PROMPT, "conv") for _ in range(4)] == [(a, "round-robin"), (b, "round-robin")] * 2


def test_a_worker_of_another_model_and_a_second_address_of_one_worker_get_nothing(caplog):
    pool = pool_of(card("a"), card("b", fingerprint="other"), card("a"))
    a = next(iter(pool.clients.values()))
    assert pool.serving() == [a]
    assert sum("serves another model" in r.message for r in caplog.records) == 1
    pool.serving()
    assert sum("serves another model" in r.message for r in caplog.records) == 1  # said once


def test_a_lost_worker_is_forgotten_and_a_new_instance_starts_empty():
    pool = pool_of(card("a"), card("b"))
    a, b = pool.clients.values()
    beat(a, running=1, holds=PROMPT)
    a.receive(card("a2"))  # the worker restarted: what its last heartbeat said is gone
    assert a.prefixes == frozenset() and a.load == 0
    beat(b, running=1, holds=PROMPT)
    b.give_up("gone")
    assert pool.serving() == [a] and b.prefixes == frozenset()


def test_affinity_keys():
    def request(messages, hint=None, prompt=None):
        return NeutralRequest("chat", "m", messages, cache_hint=hint, prompt=prompt)

    opening = [{"role": "system", "content": "S"}, {"role": "user", "content": "first"}]
    later = opening + [{"role": "assistant", "content": "r"}, {"role": "user", "content": "second"}]
    assert affinity_key(request(opening), []) == affinity_key(request(later), [])
    assert affinity_key(request(opening), []) != affinity_key(
        request([{"role": "system", "content": "S"}, {"role": "user", "content": "other"}]), [])
    assert affinity_key(request(later, hint="session-1"), []) == "session:session-1"
    assert affinity_key(request([], prompt="text"), PROMPT) == prefix_digests(PROMPT)[0].hex()
    assert affinity_key(request([], prompt="text"), PROMPT[:5]) is None


def test_endpoints_and_names():
    assert parse_endpoints("tcp://a:1, tcp://b:2,") == ["tcp://a:1", "tcp://b:2"]
    assert parse_endpoints("") == [DEFAULT_ENDPOINT]
    assert "tcp://127.0.0.1:5557" in resolve("dns+tcp://localhost:5557")  # the hosts file, for real
    assert resolve("dns+tcp://no-such-name.invalid:5557") == []


@pytest.mark.parametrize("policy", ["random"])
def test_an_unknown_policy_is_refused(policy):
    with pytest.raises(ValueError, match="routing policy"):
        WorkerPool("tcp://a:1", 1.0, 6.0, policy=policy)


def test_workers_gone_from_the_name_are_retired_once_idle():
    async def run():
        pool = WorkerPool("tcp://127.0.0.1:9101,tcp://127.0.0.1:9102", 1.0, 6.0)
        await pool.start()
        try:
            assert set(pool.clients) == {"tcp://127.0.0.1:9101", "tcp://127.0.0.1:9102"}
            pool.specs = ["tcp://127.0.0.1:9101"]  # as if the name stopped resolving to the second
            await pool.refresh()
            assert set(pool.clients) == {"tcp://127.0.0.1:9101"} and pool.retired == []
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_failed_lookup_keeps_the_workers_last_found(monkeypatch):
    import gateway.worker_pool as worker_pool

    async def run():
        pool = WorkerPool("dns+tcp://localhost:9103", 1.0, 6.0)
        await pool.start()  # a real lookup: the hosts file
        try:
            assert "tcp://127.0.0.1:9103" in pool.clients
            monkeypatch.setattr(worker_pool, "resolve", lambda spec: [])  # the resolver is down for a while
            await pool.refresh()
            assert "tcp://127.0.0.1:9103" in pool.clients and pool.retired == []
        finally:
            await pool.close()

    asyncio.run(run())
