"""What a gateway knows of the model (from the worker's MODEL_CARD) and how it builds prompts.

The same rendering serves generation and the token counting endpoints, so a count is always
the prompt that would run.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.chat_template import ChatTemplate
from shared.errors import ContextOverflowError, InvalidRequestError
from shared.protocol import ModelCard
from shared.tokenizer import Tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A plain ChatML rendering for GGUFs that carry no template.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ModelView:
    card: ModelCard
    tokenizer: Tokenizer
    template: ChatTemplate

    @classmethod
    def from_card(cls, card: ModelCard) -> "ModelView":
        tokenizer = Tokenizer.from_spec(card.tokenizer)

        def text(token_id: int | None) -> str:
            return tokenizer.id_to_piece(token_id) if token_id is not None else ""

        template = ChatTemplate(card.chat_template or FALLBACK_TEMPLATE,
                                bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id))
        return cls(card, tokenizer, template)

    @property
    def model_id(self) -> str:
        return self.card.model_id

    @property
    def context_budget(self) -> int:
        return self.card.context_budget

    @property
    def has_reasoning_channel(self) -> bool:
        """A model can think on request when its vocabulary has the think tags and its template
        knows the enable_thinking switch."""
        vocab_has_tags = (self.tokenizer.piece_to_id(THINK_OPEN) is not None
                          and self.tokenizer.piece_to_id(THINK_CLOSE) is not None)
        return vocab_has_tags and "enable_thinking" in self.template.source

    @property
    def has_tool_convention(self) -> bool:
        """A model calls tools the Hermes way (``<tool_call>`` blocks, see gateway/tool_calls.py)
        when its vocabulary has the call tags and its template shows tools and calls."""
        vocab_has_tags = (self.tokenizer.piece_to_id(TOOL_CALL_OPEN) is not None
                          and self.tokenizer.piece_to_id(TOOL_CALL_CLOSE) is not None)
        source = self.template.source
        return vocab_has_tags and "tools" in source and "tool_call" in source

    def render(self, messages: list[dict], tools: list[dict] | None = None, reasoning: bool = False,
               prefill: str = "") -> str:
        enable_thinking = reasoning if self.has_reasoning_channel else None
        text = self.template.render(messages, tools=tools or None, add_generation_prompt=True,
                                    enable_thinking=enable_thinking)
        return text + prefill

    def encode_prompt(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_id
        # Templates that write the BOS text themselves must not get a second one.
        already = bos is not None and text.startswith(self.tokenizer.id_to_piece(bos))
        ids = self.tokenizer.encode(text, add_special=not already)
        if self.tokenizer.add_eos and ids and ids[-1] == self.tokenizer.eos_id:
            ids.pop()  # a prompt never ends the turn it asks the model to write
        return ids

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None, reasoning: bool = False,
                   prefill: str = "") -> list[int]:
        if not messages and not prefill:
            raise InvalidRequestError("there are no messages to answer", param="messages")
        return self.encode_prompt(self.render(messages, tools, reasoning, prefill))

    def check_fits(self, prompt_tokens: int) -> None:
        if prompt_tokens >= self.context_budget:
            raise ContextOverflowError(prompt_tokens, self.context_budget)
