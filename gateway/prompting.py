"""What a gateway knows of the model (from the worker's MODEL_CARD) and how it builds prompts.

The same rendering serves generation and the token counting endpoints, so a count is always
the prompt that would run.
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from shared import conventions
from shared.chat_template import ChatTemplate
from shared.conventions.base import Convention
from shared.errors import ContextOverflowError, InvalidRequestError, TemplateError
from shared.protocol import ModelCard, Tags
from shared.tokenizer import Tokenizer, trie_pattern

NO_TEMPLATE = ("this model has no chat template (it is a base model): send plain text to POST /v1/completions, "
               "or start the worker with --chat-template FILE")


@dataclass
class ModelView:
    card: ModelCard
    tokenizer: Tokenizer
    template: ChatTemplate | None  # None: a base model, served by text completions only
    # the text of every control token, to find where a client spells one out
    control_texts: re.Pattern | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        texts = {self.tokenizer.id_to_piece(i) for i in self.tokenizer.special_ids} - {""}
        self.control_texts = re.compile(trie_pattern(texts)) if texts else None

    @classmethod
    def from_card(cls, card: ModelCard) -> "ModelView":
        tokenizer = Tokenizer.from_spec(card.tokenizer, encoder=True)  # every request encodes: built now

        def text(token_id: int | None) -> str:
            return tokenizer.id_to_piece(token_id) if token_id is not None else ""

        template = (ChatTemplate(card.chat_template, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id))
                    if card.chat_template else None)
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
        """The tags of the model's call blocks (gateway/tool_calls.py), None when it has no
        tool convention."""
        return self.card.capabilities.tool_call_tags

    @property
    def convention(self) -> Convention:
        """How the model writes its reasoning and calls (``shared/conventions/``): the one its
        card names, which the card's decoding has checked is registered."""
        return conventions.get(self.card.capabilities.convention)

    def render(self, messages: list[dict], tools: list[dict] | None = None, reasoning: bool = False,
               prefill: str = "", effort: str | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text. ``effort``: how hard the client asked the model to think (an OpenAI
        effort word), for a template that takes it (Inkling's ``reasoning_effort``).
        ``template_kwargs``: the client's own template variables, over the reasoning switch."""
        if self.template is None:
            raise InvalidRequestError(NO_TEMPLATE, param="messages")
        convention = self.convention
        switch: dict[str, Any] = convention.template_switch(reasoning, effort) if self.has_reasoning_channel else {}
        if not self.takes_late_system:
            messages = fold_late_system(messages)
        text = self.template.render(messages, tools=tools or None, add_generation_prompt=True,
                                    **{**switch, **(template_kwargs or {})})
        return text + convention.prefill_opens + prefill if prefill else text

    @functools.cached_property
    def takes_late_system(self) -> bool:
        """Whether the template renders a system message that is not the conversation's first
        (Claude Code 2.x sends one after its first user message, Codex several developer messages
        after its instructions); many refuse one (Qwen3.5's, for one), so each is asked once."""
        assert self.template is not None
        try:
            self.template.render([{"role": "user", "content": "?"}, {"role": "system", "content": "?"}])
        except TemplateError:
            return False
        return True

    def encode_prompt(self, text: str, quoted: ClientText | None = None) -> list[int]:
        """The ids of a rendered prompt. With ``quoted``, its markers stand for text a client
        wrote, which is read as plain text: a control token spelled out there is not one."""
        tokenizer = self.tokenizer
        if quoted is None or not quoted.originals:
            return tokenizer.encode_prompt(text)
        bos = tokenizer.bos_id
        # Templates that write the BOS text themselves must not get a second one.
        already = bos is not None and text.startswith(tokenizer.id_to_piece(bos))
        ids = [bos] if tokenizer.add_bos and not already else []
        for i, part in enumerate(quoted.marker.split(text)):
            # a piece continues the one before unless it starts the text or follows a control
            # token (where a SentencePiece vocabulary's leading-space rule applies again)
            continuation = bool(ids) and ids[-1] not in tokenizer.special_ids
            if i % 2:  # a marker's number: the client's text, tokenized as plain text
                ids += tokenizer.encode(quoted.originals[int(part)], add_special=False, parse_special=False,
                                        continuation=continuation)
            elif part:
                ids += tokenizer.encode(part, add_special=False, continuation=continuation)
        # no EOS is added after the last piece: a prompt never ends the turn it asks for
        return ids

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None, reasoning: bool = False,
                   prefill: str = "", effort: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's ids. One far longer than the context is refused before it is tokenized
        (its length in characters bounds its tokens from below), so a huge body costs its
        rendering, not seconds of tokenizing and a tokenizer's worth of memory."""
        if not messages and not prefill:
            raise InvalidRequestError("there are no messages to answer", param="messages")
        if self.template is None:
            raise InvalidRequestError(NO_TEMPLATE, param="messages")
        # the client's text alone already too long: refused before it is scanned or rendered
        self.refuse_beyond_context(text_length((messages, tools, prefill, template_kwargs)))
        quoted = ClientText(self.control_texts)
        messages, tools, prefill = quoted.mark(messages), quoted.mark(tools), quoted.mark(prefill)
        text = self.render(messages, tools, reasoning, prefill, effort, quoted.mark(template_kwargs or {}))
        self.refuse_beyond_context(len(text))
        return self.encode_prompt(text, quoted)

    def text_prompt_ids(self, prompt: str | list[int], suffix: str | None = None) -> list[int]:
        """A text completion's prompt as it is: token ids checked against the vocabulary, or
        text tokenized with the vocabulary's BOS (no template, control tokens live: the whole
        prompt is the client's to write).

        With a ``suffix``, the prompt is the text before a gap and the suffix the text after it,
        laid out prefix-suffix-middle as fill-in-the-middle models are trained: BOS where the
        vocabulary adds one, then <prefix> prompt <suffix> suffix <middle>; the model writes the
        gap. The caller has checked the vocabulary has the three tokens."""
        if isinstance(prompt, list):
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"'prompt' holds {bad}, which is not a token id of this model "
                                          f"(0 to {vocab - 1})", param="prompt")
            ids = list(prompt)
        else:
            self.refuse_beyond_context(len(prompt) + len(suffix or ""))
            if suffix is None:
                ids = self.encode_prompt(prompt)
            else:  # the BOS goes before the prefix token
                ids = self.tokenizer.encode(prompt, add_special=False)
        if suffix is not None:
            tokenizer = self.tokenizer
            prefix_id, suffix_id, middle_id = tokenizer.fim_ids
            bos = [tokenizer.bos_id] if tokenizer.add_bos else []  # a spec that adds BOS names it
            return [*bos, prefix_id, *ids, suffix_id, *tokenizer.encode(suffix, add_special=False), middle_id]
        if not ids:
            raise InvalidRequestError("'prompt' is empty: there is nothing to continue", param="prompt")
        return ids

    def refuse_beyond_context(self, chars: int) -> None:
        """Refuse text that cannot fit before tokenizing it: no token stands for more than
        ``max_token_chars`` characters, so ``chars`` bounds its tokens from below."""
        at_least = -(-chars // self.tokenizer.max_token_chars)
        if at_least >= self.context_budget:
            raise ContextOverflowError(at_least, self.context_budget, at_least=True)

    def check_fits(self, prompt_tokens: int) -> None:
        if prompt_tokens >= self.context_budget:
            raise ContextOverflowError(prompt_tokens, self.context_budget)


class ClientText:
    """Keeps a client from writing control tokens (``<|im_end|>\n<|im_start|>system…``) into
    its prompt. Each spelled-out control token in the request's strings is swapped for a marker
    that no client can guess (a fresh nonce), the template renders around the markers, and
    ``encode_prompt`` tokenizes what a marker stands for as plain text. A request that spells
    none out renders and tokenizes exactly as before."""

    def __init__(self, control_texts: re.Pattern | None):
        self.control_texts = control_texts
        nonce = secrets.token_hex(8)
        # plain ASCII, so that it passes unchanged through a template's tojson, trim or escape
        self.marker = re.compile(rf"\[\[q{nonce}:(\d+)\]\]")
        self._format = f"[[q{nonce}:{{}}]]"
        self.originals: list[str] = []

    def mark(self, value: Any) -> Any:
        """``value`` with every control-token text in its strings marked, keys included (a
        template prints tool schemas and call arguments whole, with tojson)."""
        if self.control_texts is None:
            return value
        if isinstance(value, str):
            return self.control_texts.sub(self._swap, value)
        if isinstance(value, dict):
            return {self.mark(key): self.mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(item) for item in value]
        return value

    def _swap(self, match: re.Match) -> str:
        self.originals.append(match.group(0))
        return self._format.format(len(self.originals) - 1)


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that takes a system message first only: the system
    messages that open it become one, and each later one becomes text of a user turn, where a
    client that could not send it as a system message would have put it: the user turn it
    follows, else the next one, else one of its own at the end. A conversation's earlier turns
    render as before when it grows, so its cached prefix still serves."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # later system texts waiting for the next user turn
    for message in messages:
        role, content = message.get("role"), message.get("content")
        previous = out[-1] if out else {}
        joinable = isinstance(previous.get("content"), str)
        if role == "system" and len(out) == 1 and previous.get("role") == "system" and joinable:
            out[0] = {**previous, "content": _joined(previous["content"], content)}
        elif role == "system" and previous.get("role") == "user" and joinable:
            out[-1] = {**previous, "content": _joined(previous["content"], content)}
        elif role == "system" and out:
            pending.append(_joined(content))
        elif role == "user" and pending and isinstance(content, str):
            out.append({**message, "content": _joined(*pending, content)})
            pending = []
        else:
            out.append(message)
    if pending:
        out.append({"role": "user", "content": _joined(*pending)})
    return out


def _joined(*texts: Any) -> str:
    return "\n\n".join(text for text in texts if isinstance(text, str) and text)


def text_length(value: Any) -> int:
    """Characters in every string of a value, keys included."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_length(key) + text_length(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_length(item) for item in value)
    return 0
