"""Several API keys are several tenants: each key's cached prompts are its own, so no tenant
reuses another's KV or learns from a cache hit what another sent; --share-cache joins them.
Through real gateways on the shared worker, with the official SDK."""

from __future__ import annotations

import openai
import pytest

SYSTEM = ("You are the archivist of the tenants' test. " + "Keep every ledger entry exact. " * 40).strip()


def _cached(gateway, key: str, system: str) -> int:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="any", max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Entry one?"}])
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def tenants(start_gateway, stack_worker):
    return start_gateway(stack_worker, "--api-key", "key-of-alice,key-of-bob")


def test_a_tenant_reuses_its_own_prompts_and_never_another_s(tenants):
    system = SYSTEM + " (apart)"
    assert _cached(tenants, "key-of-alice", system) == 0
    assert _cached(tenants, "key-of-alice", system) > 200  # her own, resident
    assert _cached(tenants, "key-of-bob", system) == 0  # the same prompt: nothing of hers
    assert _cached(tenants, "key-of-bob", system) > 200  # his own now
    with pytest.raises(openai.AuthenticationError):
        _cached(tenants, "key-of-mallory", system)


def test_share_cache_lets_the_keys_reuse_each_other_s_prompts(start_gateway, stack_worker):
    shared = start_gateway(stack_worker, "--api-key", "key-of-alice,key-of-bob", "--share-cache")
    system = "(shared) " + SYSTEM
    # the shared namespace is everyone's: other tests' conversations may share the template's opening
    assert _cached(shared, "key-of-alice", system) < 20
    assert _cached(shared, "key-of-bob", system) > 200
