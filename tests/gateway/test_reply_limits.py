"""Server limits and reasoning budgets through the real stack, with the official SDKs.

The model is the tiny random qwen3 (real Qwen vocabulary, ``<think>`` tags as tokens) under
``--scripted-replies``: a reply that thinks for 60 words and then answers, a reply of 3,000
words (longer than any deadline here lets a worker write), and a short one. Three gateways
share its worker: one without limits (budgets), one with ``--max-output-tokens 8`` and one with
``--max-request-seconds 1``.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from tiny_models import write_tiny_gguf

from gateway.app import TRUNCATED_HEADER

THOUGHT_WORDS = 60
ANSWER = "The answer is 42."
SCRIPT = [
    {"when": "[[think-long]]", "text": "<think>\n" + "step " * THOUGHT_WORDS + "\n</think>\n\n" + ANSWER},
    {"when": "[[long]]", "text": "word " * 3000},
    {"when": "[[short]]", "text": "one two three four five six seven eight nine ten eleven twelve thirteen"},
]
CAP = 8  # --max-output-tokens
NO_SPECULATION = {"speculation": False}  # one token per pass: the deadline meets a slow reply


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, start_worker, start_gateway):
    folder = tmp_path_factory.mktemp("reply-limits")
    model = folder / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=4096)
    script = folder / "replies.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    worker = start_worker(model, "--scripted-replies", str(script), "--batch", "2", "--ctx", "4096")
    return {"plain": start_gateway(worker), "capped": start_gateway(worker, "--max-output-tokens", str(CAP)),
            "timed": start_gateway(worker, "--max-request-seconds", "1")}


def oai(gateways, which: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateways[which].url + "/v1", api_key="x", max_retries=0)


def claude(gateways, which: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateways[which].url, api_key="x", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- reasoning budgets ----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_in_messages_caps_the_reasoning_and_the_answer_follows(gateways, qwen_tokenizer, stream):
    budget = 10
    kwargs = dict(model="m", max_tokens=200, messages=user("[[think-long]]"),
                  thinking={"type": "enabled", "budget_tokens": budget})
    client = claude(gateways, "plain")
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    thinking = "".join(block.thinking for block in message.content if block.type == "thinking")
    text = "".join(block.text for block in message.content if block.type == "text")
    # the block's tokens, its closing </think> among them, are the budget: its words are fewer
    assert thinking.startswith("step") and 0 < len(qwen_tokenizer.encode(thinking, add_special=False)) < budget
    assert text == ANSWER and message.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_effort_in_chat_is_a_budget_of_a_share_of_max_tokens(gateways, stream):
    client = oai(gateways, "plain")
    # low: 1024 tokens or a quarter of max_tokens, the smaller; 40 // 4 = 10
    kwargs = dict(model="m", messages=user("[[think-long]]"), max_tokens=40, reasoning_effort="low")
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        reply = client.chat.completions.create(**kwargs)
        content, reasoning = reply.choices[0].message.content, reply.choices[0].message.reasoning_content
        usage, finish = reply.usage, [reply.choices[0].finish_reason]
    assert usage.completion_tokens_details.reasoning_tokens == 10
    assert reasoning.startswith("step") and reasoning.count("step") < THOUGHT_WORDS
    assert content == ANSWER and finish == ["stop"]


def test_without_a_budget_the_scripted_reply_thinks_for_all_its_words(gateways):
    reply = oai(gateways, "plain").chat.completions.create(model="m", messages=user("[[think-long]]"),
                                                           max_tokens=200, reasoning_effort="xhigh")
    assert reply.choices[0].message.reasoning_content.count("step") == THOUGHT_WORDS
    assert reply.usage.completion_tokens_details.reasoning_tokens > THOUGHT_WORDS
    assert reply.choices[0].message.content == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_effort_in_responses_caps_the_reasoning(gateways, stream):
    client = oai(gateways, "plain")
    kwargs = dict(model="m", input="[[think-long]]", max_output_tokens=40, reasoning={"effort": "low"})
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    assert response.usage.output_tokens_details.reasoning_tokens == 10
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                        for part in (item.content or []))
    assert reasoning.startswith("step") and reasoning.count("step") < THOUGHT_WORDS
    assert response.output_text == ANSWER and response.status == "completed"


# --- --max-output-tokens --------------------------------------------------------------------

def test_max_output_tokens_caps_what_a_chat_request_asks_and_gives_the_rest_that_many(gateways):
    client = oai(gateways, "capped")
    for asked in (None, 100):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=user("[[short]]"), **({"max_tokens": asked} if asked else {}))
        reply = raw.parse()
        assert reply.usage.completion_tokens == CAP and reply.choices[0].finish_reason == "length"
        assert raw.headers[TRUNCATED_HEADER] == "max_output_tokens"
        assert reply.usage.model_extra["truncated"] == "max_output_tokens"
    # a request asking for less is cut by its own limit: nothing for the server to say
    raw = client.chat.completions.with_raw_response.create(model="m", messages=user("[[short]]"), max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4 and TRUNCATED_HEADER not in raw.headers


def test_max_output_tokens_in_messages_and_responses(gateways):
    message = claude(gateways, "capped").messages.create(model="m", max_tokens=100, messages=user("[[short]]"))
    assert message.usage.output_tokens == CAP and message.stop_reason == "max_tokens"
    response = oai(gateways, "capped").responses.create(model="m", input="[[short]]")
    assert response.usage.output_tokens == CAP and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


# --- --max-request-seconds ------------------------------------------------------------------

def test_a_chat_reply_past_its_deadline_ends_as_if_at_its_length(gateways):
    raw = oai(gateways, "timed").chat.completions.with_raw_response.create(
        model="m", messages=user("[[long]]"), max_tokens=3500, extra_body=NO_SPECULATION)
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length" and raw.headers[TRUNCATED_HEADER] == "deadline"
    assert 0 < reply.usage.completion_tokens < 3000 and reply.usage.model_extra["truncated"] == "deadline"
    assert reply.choices[0].message.content.startswith("word word")


def test_a_streamed_reply_past_its_deadline_says_why_in_its_usage(gateways):
    events = list(claude(gateways, "timed").messages.create(model="m", max_tokens=3500, messages=user("[[long]]"),
                                                            stream=True, extra_body=NO_SPECULATION))
    [delta] = [event for event in events if event.type == "message_delta"]  # the totals, at the end
    assert delta.delta.stop_reason == "max_tokens" and 0 < delta.usage.output_tokens < 3000
    assert delta.usage.model_extra["truncated"] == "deadline"
    events = list(oai(gateways, "timed").responses.create(model="m", input="[[long]]", stream=True,
                                                          extra_body=NO_SPECULATION))
    response = events[-1].response
    assert events[-1].type == "response.incomplete" and response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.model_extra["truncated"] == "deadline" and 0 < response.usage.output_tokens < 3000
