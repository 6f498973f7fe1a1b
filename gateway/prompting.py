"""What a gateway knows of the model (from the worker's MODEL_CARD) and how it builds prompts.

The same rendering serves generation and the token counting endpoints, so a count is always
the prompt that would run.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.chat_template import ChatTemplate
from shared.errors import ContextOverflowError, InvalidRequestError
from shared.protocol import ModelCard, Tags
from shared.tokenizer import Tokenizer

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
        """The model thinks on request (the worker saw the switch in its template)."""
        return self.card.capabilities.reasoning

    @property
    def reasoning_tags(self) -> Tags:
        return self.card.capabilities.reasoning_tags

    @property
    def tool_call_tags(self) -> Tags | None:
        """The tags of the model's Hermes call blocks (gateway/tool_calls.py), None when it has
        no tool convention."""
        return self.card.capabilities.tool_call_tags

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
