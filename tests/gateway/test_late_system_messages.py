"""System messages after a conversation's first message (gateway/prompting.py): Claude Code 2.x
sends one after its first user message, Codex sends its developer messages one after another. A
template that renders them gets them as they are; one that refuses them (as Qwen3.5's does, and
the test Hermes template) gets them folded into the opening system message or a user turn,
rather than the client getting a 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.prompting import ModelView
from shared.errors import TemplateError
from shared.protocol import Capabilities, ModelCard, Tags

REFUSING = (Path(__file__).resolve().parents[1] / "templates" / "qwen3_hermes.jinja").read_text(encoding="utf-8")
TAKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALL = {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}
# Claude Code's first request, and its second after one tool call
CLAUDE_FIRST = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."},
                {"role": "system", "content": "# Environment\ncwd: /work"}]
CLAUDE_SECOND = CLAUDE_FIRST + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "README.md"}]
# Codex's: its developer messages (system in the template's terms), then the user's
CODEX = [{"role": "system", "content": "You are a coding agent."}, {"role": "system", "content": "<skills/>"},
         {"role": "user", "content": "List the files."}]


def view_of(template: str, tokenizer) -> ModelView:
    capabilities = Capabilities(4096, Tags("<think>", "</think>"), tool_call_tags=Tags("<tool_call>", "</tool_call>"))
    card = ModelCard(2, "m", "qwen3", 4096, tokenizer.vocab_size, tokenizer.to_spec(), template, "fp", capabilities)
    return ModelView.from_card(card)


@pytest.fixture(scope="module")
def refusing(qwen_tokenizer) -> ModelView:
    return view_of(REFUSING, qwen_tokenizer)


def test_the_refusing_template_does_refuse_them(refusing):
    # what the clients got before: the template's own error, a 400
    for messages in (CLAUDE_FIRST, CODEX):
        with pytest.raises(TemplateError, match="only allowed first"):
            refusing.template.render(messages)
    assert not refusing.takes_late_system


def test_claude_codes_late_system_message_joins_the_user_turn_before_it(refusing):
    first = refusing.render(CLAUDE_FIRST)
    assert first.count("<|im_start|>system") == 1
    assert "<|im_start|>user\nList the files.\n\n# Environment\ncwd: /work<|im_end|>" in first
    # the next turn renders the earlier ones as before: the cached prefix still serves
    second = refusing.render(CLAUDE_SECOND)
    assert second.startswith(first.removesuffix("<|im_start|>assistant\n"))
    assert "<tool_response>\nREADME.md\n</tool_response>" in second
    assert refusing.prompt_ids(CLAUDE_SECOND)  # and it tokenizes like any prompt


def test_codexs_opening_system_messages_become_one(refusing):
    text = refusing.render(CODEX)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n<skills/><|im_end|>\n"
                           "<|im_start|>user\nList the files.<|im_end|>")


def test_a_late_system_message_with_no_user_turn_beside_it_becomes_one(refusing):
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Be brief."}]
    assert refusing.render(messages).endswith("<|im_start|>user\nBe brief.<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_takes_them_gets_them_as_sent(qwen_tokenizer):
    view = view_of(TAKING, qwen_tokenizer)
    assert view.takes_late_system
    assert view.render(CLAUDE_FIRST).count("<|im_start|>system") == 2
    assert view.render(CODEX).count("<|im_start|>system") == 2
