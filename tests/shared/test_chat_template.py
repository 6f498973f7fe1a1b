"""Chat templates rendered in the sandbox: real templates, the helpers they use, and failures."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest

from shared.chat_template import ChatTemplate, chat_template_from_metadata
from shared.errors import TemplateError

QWEN3_TEMPLATE = (Path(__file__).resolve().parents[1] / "templates" / "qwen3_hermes.jinja").read_text()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def test_smollm_template_renders_a_two_turn_chat(smollm_metadata):
    template = chat_template_from_metadata(smollm_metadata)
    prompt = template.render([
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How are you?"},
    ], add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    )
    without = template.render([{"role": "user", "content": "Hi!"}], add_generation_prompt=False)
    assert without.endswith("Hi!<|im_end|>\n")


def test_rendered_prompt_tokenizes_with_control_tokens(smollm_metadata, smollm_tokenizer):
    prompt = chat_template_from_metadata(smollm_metadata).render([{"role": "user", "content": "Hi"}])
    ids = smollm_tokenizer.encode(prompt)
    assert ids[0] == 1 and ids[-4:] == smollm_tokenizer.encode("<|im_start|>assistant\n")
    assert ids.count(2) == 2  # two <|im_end|>: system and user turns


def test_bos_and_eos_tokens_come_from_metadata(smollm_metadata):
    template = chat_template_from_metadata(smollm_metadata)
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    probe = ChatTemplate("{{ bos_token }}|{{ eos_token }}", template.bos_token, template.eos_token)
    assert probe.render([]) == "<|im_start|>|<|im_end|>"


def test_metadata_without_template_gives_none():
    assert chat_template_from_metadata({"tokenizer.ggml.tokens": ["a"]}) is None


def test_tools_reach_the_template():
    prompt = ChatTemplate(QWEN3_TEMPLATE).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
        tools=[WEATHER_TOOL],
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # tojson keeps non-ASCII text as is (Jinja's own filter would escape it)
    assert '"description": "Météo actuelle d\'une ville"' in prompt
    assert "<tools>\n{\"type\": \"function\"" in prompt
    assert prompt.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")


def test_enable_thinking_reaches_the_template():
    template = ChatTemplate(QWEN3_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(messages, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert template.render(messages).endswith("<|im_start|>assistant\n")  # left undefined


def test_qwen3_template_renders_a_tool_round_trip():
    messages = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two tools.",
         "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
         ]},
        {"role": "tool", "tool_call_id": "a", "content": "18°C"},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
    ]
    assert ChatTemplate(QWEN3_TEMPLATE).render(messages) == (
        "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo tools.\n</think>\n\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_template_drops_reasoning_of_earlier_turns():
    prompt = ChatTemplate(QWEN3_TEMPLATE).render([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "c"},
    ])
    assert "old thoughts" not in prompt and "<|im_start|>assistant\nb<|im_end|>" in prompt


def test_qwen3_template_in_the_vocab_metadata_is_ours(qwen_metadata):
    assert qwen_metadata["tokenizer.chat_template"] == QWEN3_TEMPLATE
    template = chat_template_from_metadata(qwen_metadata)
    assert template.eos_token == "<|im_end|>"


def test_extra_variables_pass_through():
    template = ChatTemplate("{{ reasoning_effort }}/{{ messages | length }}")
    assert template.render([{"role": "user", "content": "x"}], reasoning_effort="high") == "high/1"


def test_loop_and_namespace_work():
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{% if loop.last %}{{ ns.n }}:{{ m.content }}{% endif %}{% endfor %}"
              "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    assert ChatTemplate(source).render([{"content": "a"}, {"content": "b"}]) == "2:b01"


def test_tojson_indent_and_generation_block():
    source = "{% generation %}{{ tools[0] | tojson(indent=2) }}{% endgeneration %}"
    rendered = ChatTemplate(source).render([], tools=[{"a": "ü"}])
    assert rendered == '{\n  "a": "ü"\n}'


def test_strftime_now():
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    today = datetime.now()
    assert rendered in {today.strftime("%Y-%m-%d"), (today - timedelta(days=1)).strftime("%Y-%m-%d")}


# --- failures become TemplateError ------------------------------------------------------------

def test_raise_exception_carries_the_template_message():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    with pytest.raises(TemplateError, match="Conversation roles must alternate user/assistant") as info:
        template.render([])
    assert info.value.status == 400


def test_qwen3_template_rejects_an_unknown_role():
    with pytest.raises(TemplateError, match="unknown message role: narrator"):
        ChatTemplate(QWEN3_TEMPLATE).render([{"role": "narrator", "content": "x"}])


def test_syntax_error_is_reported_with_its_line():
    with pytest.raises(TemplateError, match="line 2"):
        ChatTemplate("{% for m in messages %}\n{{ m.content }")


def test_empty_template_is_refused():
    with pytest.raises(TemplateError):
        ChatTemplate("   ")


def test_undefined_misuse_is_a_template_error():
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render([])


def test_python_error_inside_the_template_is_a_template_error():
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ 1 + messages }}").render([])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__init__.__globals__ }}",
    "{{ messages.append(1) }}",  # the sandbox is immutable
    "{{ 'x' * 100000000 }}",
    "{{ 10 ** 100000000 }}",
])
def test_sandbox_blocks_escapes_and_blowups(source):
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
