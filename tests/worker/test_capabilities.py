"""Capabilities from a real vocabulary and template: Qwen3's (think tags with the enable_thinking
switch, Hermes call tags), Gemma 4's (a thought channel, its own call blocks), Inkling's (blocks,
with the reasoning_effort switch) and SmolLM2's (neither)."""

from __future__ import annotations

from conftest import REPO

from shared.chat_template import ChatTemplate, chat_template_from_metadata
from shared.conventions.hermes import CALLS as HERMES_CALL_TAGS
from worker.capabilities import has_reasoning_switch, tool_call_tags

QWEN3_TEMPLATE = ChatTemplate((REPO / "tests" / "templates" / "qwen3_hermes.jinja").read_text())


def test_qwen3_thinks_on_request_and_calls_tools_in_hermes_blocks(qwen_tokenizer):
    assert has_reasoning_switch(qwen_tokenizer, QWEN3_TEMPLATE)
    assert tool_call_tags(qwen_tokenizer, QWEN3_TEMPLATE) == HERMES_CALL_TAGS


def test_the_tags_alone_are_not_a_convention(qwen_tokenizer):
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not has_reasoning_switch(qwen_tokenizer, plain)
    assert tool_call_tags(qwen_tokenizer, plain) is None
    assert not has_reasoning_switch(qwen_tokenizer, None) and tool_call_tags(qwen_tokenizer, None) is None


def test_smollm2_has_neither(smollm_tokenizer, smollm_metadata):
    template = chat_template_from_metadata(smollm_metadata)
    assert not has_reasoning_switch(smollm_tokenizer, template)
    assert tool_call_tags(smollm_tokenizer, template) is None


def test_a_file_without_a_template_has_none(smollm_metadata):
    for source in (None, "", "  \n"):
        assert chat_template_from_metadata({**smollm_metadata, "tokenizer.chat_template": source}) is None
    template = chat_template_from_metadata(smollm_metadata)
    assert template is not None and template.source == smollm_metadata["tokenizer.chat_template"]


def test_gemma4_thinks_in_its_channel_and_calls_in_its_own_blocks():
    from gemma4_vocab import gemma4_vocab_metadata

    from shared.tokenizer import Tokenizer
    from shared.conventions.gemma4 import CALLS as GEMMA4_CALL_TAGS
    from shared.conventions.gemma4 import GEMMA4
    from worker.capabilities import convention

    metadata = gemma4_vocab_metadata()
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    template = chat_template_from_metadata(metadata)
    assert convention(tokenizer) is GEMMA4
    assert has_reasoning_switch(tokenizer, template)
    assert tool_call_tags(tokenizer, template) == GEMMA4_CALL_TAGS


def test_a_vocabulary_without_markers_follows_hermes_and_has_neither(smollm_tokenizer):
    from shared.conventions.hermes import HERMES
    from worker.capabilities import convention

    assert convention(smollm_tokenizer) is HERMES


def test_inkling_thinks_by_its_effort_and_calls_in_its_blocks():
    from inkling_vocab import inkling_vocab_metadata

    from shared.tokenizer import Tokenizer
    from shared.conventions.inkling import INKLING
    from worker.capabilities import convention

    metadata = inkling_vocab_metadata()
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    template = chat_template_from_metadata(metadata)
    assert convention(tokenizer) is INKLING
    assert has_reasoning_switch(tokenizer, template)
    assert tool_call_tags(tokenizer, template) == INKLING.calls
    # a template that knows neither the effort nor the tool declaration: neither
    plain = ChatTemplate("{% for m in messages %}<|message_user|>{{ m['content'] }}{% endfor %}{{ tools }}")
    assert not has_reasoning_switch(tokenizer, plain) and tool_call_tags(tokenizer, plain) is None
