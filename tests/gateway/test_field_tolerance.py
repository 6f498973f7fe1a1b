"""Unknown request fields are ignored and named in ``x-lmserve-ignored-fields`` (a gateway with
``--strict-fields`` refuses them), and ``chat_template_kwargs`` reaches the chat template, through
real HTTP with the official SDKs in every dialect."""

from __future__ import annotations

import anthropic
import openai
import pytest
from tiny_models import write_tiny_gguf

IGNORED = "x-lmserve-ignored-fields"
HI = [{"role": "user", "content": "Hi"}]


def chat_sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def claude_sdk(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)


@pytest.fixture
def strict(strict_stack):
    """A second gateway in front of the same worker, refusing unknown fields."""
    return strict_stack


# Claude Code-like: a made-up top-level field and a made-up field in a content block
MADE_UP = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_hint": "long"}]}],
           "extra_body": {"provider": {"order": ["local"]}}}


def test_anthropic_unknown_fields_are_ignored_and_named(stack):
    raw = claude_sdk(stack).messages.with_raw_response.create(model="m", max_tokens=2, **MADE_UP)
    assert raw.http_response.status_code == 200
    assert raw.headers[IGNORED] == "provider, messages[0].content[0].cache_hint"
    assert raw.parse().usage.output_tokens > 0


def test_anthropic_unknown_fields_are_named_on_a_stream_too(stack):
    with claude_sdk(stack).messages.with_streaming_response.create(model="m", max_tokens=2, stream=True,
                                                                    **MADE_UP) as response:
        assert response.headers[IGNORED] == "provider, messages[0].content[0].cache_hint"
        assert "message_stop" in "".join(response.iter_lines())


def test_anthropic_unknown_fields_are_400_under_strict_fields(strict):
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude_sdk(strict).messages.create(model="m", max_tokens=2, messages=MADE_UP["messages"])
    assert "unknown field 'messages[0].content[0].cache_hint'" in str(refused.value)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude_sdk(strict).messages.create(model="m", max_tokens=2, messages=HI, extra_body={"provider": {}})
    assert "unknown field 'provider'" in str(refused.value)
    # what it knows still passes, and a known field of the wrong type is a 400 either way
    assert claude_sdk(strict).messages.create(model="m", max_tokens=2, messages=HI).usage.output_tokens > 0


def test_a_known_field_of_the_wrong_type_stays_400(stack):
    with pytest.raises(anthropic.BadRequestError):
        claude_sdk(stack).messages.create(model="m", max_tokens=2, messages=HI, extra_body={"temperature": "hot"})
    with pytest.raises(openai.BadRequestError):
        chat_sdk(stack).chat.completions.create(model="m", max_tokens=2, messages=HI, extra_body={"top_k": "many"})


def test_openai_chat_and_responses_ignore_and_name_unknown_fields(stack, strict):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
              "x_trace": 1}]
    raw = chat_sdk(stack).chat.completions.with_raw_response.create(
        model="m", max_tokens=2, messages=parts, extra_body={"provider": {"sort": "price"}})
    assert raw.headers[IGNORED] == "provider, messages[0].x_trace, messages[0].content[0].cache_control"
    raw = chat_sdk(stack).responses.with_raw_response.create(model="m", max_output_tokens=16, input="Hi",
                                                              extra_body={"reasoning_budget": 3})
    assert raw.headers[IGNORED] == "reasoning_budget"
    raw = chat_sdk(stack).completions.with_raw_response.create(model="m", max_tokens=2, prompt="Hi",
                                                                extra_body={"best_of_n": 2})
    assert raw.headers[IGNORED] == "best_of_n"
    plain = chat_sdk(stack).chat.completions.with_raw_response.create(model="m", max_tokens=2, messages=HI)
    assert IGNORED not in plain.headers
    for call in (lambda sdk: sdk.chat.completions.create(model="m", max_tokens=2, messages=parts),
                 lambda sdk: sdk.responses.create(model="m", max_output_tokens=16, input="Hi",
                                                  extra_body={"reasoning_budget": 3}),
                 lambda sdk: sdk.completions.create(model="m", max_tokens=2, prompt="Hi", extra_body={"best_of_n": 2})):
        with pytest.raises(openai.BadRequestError, match="unknown field"):
            call(chat_sdk(strict))


def test_anthropic_token_count_names_ignored_fields(stack):
    raw = claude_sdk(stack).messages.with_raw_response.count_tokens(model="m", messages=HI,
                                                                    extra_body={"provider": {}})
    assert raw.headers[IGNORED] == "provider" and raw.parse().input_tokens > 0


def test_the_openapi_document_says_the_rule(stack, strict):
    import httpx
    tolerant = httpx.get(stack.url + "/openapi.json").json()["components"]["schemas"]["MessageRequest"]
    assert tolerant["additionalProperties"] is True and "x-lmserve-ignored-fields" in tolerant["description"]
    refusing = httpx.get(strict.url + "/openapi.json").json()["components"]["schemas"]["MessageRequest"]
    assert refusing["additionalProperties"] is False and "--strict-fields" in refusing["description"]


def test_each_field_name_is_logged_once(stack):
    for _ in range(2):
        claude_sdk(stack).messages.create(model="m", max_tokens=1, messages=HI, extra_body={"once_only_field": 1})
    log = stack.log_path.read_text()
    assert log.count('ignored unknown field "once_only_field" in /v1/messages') == 1


# --- chat_template_kwargs -------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, start_worker, start_gateway):
    """The tiny qwen3 with its Qwen3-style template (enable_thinking=false writes an empty think block)."""
    model = tmp_path_factory.mktemp("template-kwargs") / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=1024)
    return start_gateway(start_worker(model, "--ctx", "1024"))


OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ON = {"chat_template_kwargs": {"enable_thinking": True}}


def test_enable_thinking_false_changes_the_prompt_in_every_dialect(qwen3):
    oai, claude = chat_sdk(qwen3), claude_sdk(qwen3)

    def chat(extra):
        return oai.chat.completions.create(model="m", max_tokens=1, messages=HI, extra_body=extra).usage.prompt_tokens

    def responses(extra):
        return oai.responses.create(model="m", max_output_tokens=16, input="Hi", extra_body=extra).usage.input_tokens

    def messages(extra):
        return claude.messages.count_tokens(model="m", messages=HI, thinking={"type": "enabled", "budget_tokens": 1024},
                                            extra_body=extra).input_tokens

    for count in (chat, responses, messages):
        # the Qwen3 template writes "<think>\n\n</think>\n\n" into the prompt when thinking is off
        assert count(OFF) > count(ON), count.__name__
    # Anthropic's own thinking knob on, the template's switch off: the client's kwargs win
    assert messages(OFF) > messages({})


def test_template_kwargs_the_template_does_not_read_are_400(qwen3):
    with pytest.raises(openai.BadRequestError) as refused:
        chat_sdk(qwen3).chat.completions.create(model="m", max_tokens=1, messages=HI,
                                                extra_body={"chat_template_kwargs": {"thinking_budget": 5}})
    message = str(refused.value)
    assert "never reads 'thinking_budget'" in message and "enable_thinking" in message
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude_sdk(qwen3).messages.create(model="m", max_tokens=1, messages=HI,
                                          extra_body={"chat_template_kwargs": {"messages": []}})
    assert "'chat_template_kwargs.messages' is a variable the server sets itself" in str(refused.value)
    with pytest.raises(openai.BadRequestError, match="must be an object"):
        chat_sdk(qwen3).responses.create(model="m", input="Hi", extra_body={"chat_template_kwargs": ["x"]})
