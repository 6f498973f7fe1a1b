"""Render a model's chat template (``tokenizer.chat_template``) into its prompt text.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox, an unsafe attribute (``__class__``...) is an error rather than a silent blank, and a
string or list may not be multiplied into something huge. The environment matches what the
templates were written against (Hugging Face's ``apply_chat_template``): ``trim_blocks`` and
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text and takes ``indent``, and ``{% generation %}`` blocks rendered as plain text.

Every failure — syntax, ``raise_exception``, undefined misuse, sandbox violation, a Python
error inside an expression — surfaces as ``TemplateError`` (HTTP 400 at the gateway).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from shared.errors import TemplateError

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

# The variables every render sets itself (and the environment's globals): a client's
# chat_template_kwargs may set none of them.
SERVER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                              "raise_exception", "strftime_now"})

# A template may build strings and lists, but a product this large is an attack, not a prompt.
MAX_REPEAT_ITEMS = 1_000_000


class _TemplateRaised(Exception):
    """raise_exception() was called by the template."""


def _raise_exception(message: object = "") -> NoReturn:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would corrupt tool schemas in a prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    for rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        # The stock sandbox renders an unsafe attribute as a blank, hiding the attempt.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} "
                            f"object is not allowed in a chat template")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > MAX_REPEAT_ITEMS:
                    raise SecurityError("the chat template builds a sequence longer than "
                                        f"{MAX_REPEAT_ITEMS} items")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise SecurityError("the chat template raises a number to a power above 1024")
        return super().call_binop(context, operator, left, right)


def _environment() -> _StrictSandbox:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. Compiling checks the syntax; rendering runs it per request."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            parsed = environment.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc
        # the variables the template reads from its caller (Jinja's builtins like range are not)
        self.reads = frozenset(meta.find_undeclared_variables(parsed) - set(environment.globals))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool | None = None,
               **extra: Any) -> str:
        """The prompt text for ``messages`` (OpenAI-style dicts, passed through unchanged).

        enable_thinking=None leaves the variable undefined, so the template's own default holds.
        Extra keyword arguments become template variables (e.g. ``reasoning_effort``).
        """
        variables: dict[str, Any] = {
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**variables)
        except _TemplateRaised as exc:
            raise TemplateError(f"the chat template rejected the request: {exc}") from exc
        except SecurityError as exc:
            raise TemplateError(f"the chat template did something unsafe: {exc}") from exc
        except jinja2.TemplateError as exc:  # undefined misuse and other Jinja errors
            raise TemplateError(f"the chat template failed: {exc}") from exc
        except Exception as exc:
            # Anything else raised while running template code (a TypeError from adding a
            # string to a number, a KeyError...) is this template failing on these messages.
            raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc


def chat_template_from_metadata(meta: dict[str, Any], tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
    """The GGUF's own chat template with its BOS/EOS texts, or None when the file has none
    (the texts from ``tokenizer`` where the metadata no longer holds the vocabulary)."""
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source.strip():
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []
    size = tokenizer.vocab_size if tokenizer is not None else len(tokens)

    def text_of(key: str) -> str:
        index = meta.get(key)
        if not isinstance(index, int) or not 0 <= index < size:
            return ""
        return tokenizer.id_to_piece(index) if tokenizer is not None else tokens[index]

    return ChatTemplate(source, bos_token=text_of("tokenizer.ggml.bos_token_id"),
                        eos_token=text_of("tokenizer.ggml.eos_token_id"))
