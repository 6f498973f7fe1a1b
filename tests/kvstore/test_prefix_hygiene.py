"""Claude Code's prompts keep their cached prefix: the per-request billing line is stripped and a
mid-conversation system message does not rewrite earlier turns."""

from __future__ import annotations

import anthropic
import pytest


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=120)


def _system(cch: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": "You are a careful assistant. Answer briefly."}]


def test_a_changing_billing_line_does_not_break_the_cache(client):
    turn = [{"role": "user", "content": "Name a prime number between 10 and 20."}]
    first = client.messages.create(model="claude-sonnet-4-6", max_tokens=8, system=_system("fa690"), messages=turn,
                                   extra_headers={"X-Claude-Code-Session-Id": "hygiene-1"})
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    answer = "".join(b.text for b in first.content if b.type == "text") or "13"
    follow = turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another?"}]
    second = client.messages.create(model="claude-sonnet-4-6", max_tokens=4, system=_system("0b1c2"), messages=follow,
                                    extra_headers={"X-Claude-Code-Session-Id": "hygiene-1"})
    assert second.usage.cache_read_input_tokens >= prompt - 1


def test_a_mid_conversation_system_message_keeps_the_prefix(client):
    turn = [{"role": "user", "content": "Count from one to three."}]
    first = client.messages.create(model="m", max_tokens=8, system="Be brief.", messages=turn)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    answer = "".join(b.text for b in first.content if b.type == "text") or "one two three"
    follow = turn + [{"role": "assistant", "content": answer},
                     {"role": "system", "content": "From now on answer in French."},
                     {"role": "user", "content": "Again, please."}]
    second = client.messages.create(model="m", max_tokens=4, system="Be brief.", messages=follow)
    assert second.usage.cache_read_input_tokens >= prompt - 1
