"""nanochat: no reasoning, and one tool, its calculator: ``<|python_start|>`` code
``<|python_end|>``. The caller runs it; the template knows no tool declarations, so a call comes
back as a call of the request's calculator tool (``calculator_call``).
"""

from __future__ import annotations

from typing import Any

from shared.conventions.base import Convention, Functions
from shared.conventions.call_streams import CodeReader
from shared.conventions.calls import CallSyntax
from shared.conventions.hermes import THINK
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

CALLS = Tags("<|python_start|>", "<|python_end|>")
CALCULATOR_NAMES = ("python", "calculator")  # its one tool: the name its calls get by default
CALCULATOR_ARGUMENT = "code"
CALCULATOR_CODE_CHARS = 256  # a forced calculator call's code: one line, an expression


def calculator_call(tools: list[dict[str, Any]]) -> tuple[str, str]:
    """The tool a calculator call is a call of, and the argument its code goes in: the
    request's one tool, else its tool named like a calculator, else ``python``; the argument is
    that tool's first required property (or first property), else ``code``."""
    functions = [tool["function"] for tool in tools]
    chosen = functions[0] if len(functions) == 1 else next(
        (f for f in functions if f["name"] in CALCULATOR_NAMES), None)
    if chosen is None:
        return CALCULATOR_NAMES[0], CALCULATOR_ARGUMENT
    parameters = chosen.get("parameters") if isinstance(chosen.get("parameters"), dict) else {}
    properties = list(parameters.get("properties") or {})
    required = [name for name in parameters.get("required") or [] if name in properties]
    return chosen["name"], (required or properties or [CALCULATOR_ARGUMENT])[0]


class Nanochat(Convention):
    name = "nanochat"
    reasoning = THINK  # it has none: a reply is searched for Hermes's tags, and never holds them
    calls = CALLS
    call_tokens = (CALLS.open, CALLS.close)
    declares_tools = (CALLS.open,)  # its one tool is never declared: the template writes calls alone
    binds_chosen_calls = False  # its code is free text: a call it chooses to make is not held

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        name, argument = calculator_call(forced or tools)
        return CallSyntax(None, None, False, lambda raw: (name, {argument: raw}) if raw.strip() else None,
                          reader=lambda: CodeReader(name, argument))

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        """Calculator calls, whichever tool they are calls of: a line of code each."""
        ids = [tokenizer.piece_to_id(text) for text in (self.calls.open, self.calls.close)]
        calls = "tc*" if parallel else "tc?"
        start = f"start: TEXT {calls}\nTEXT: /(.|\\n)*/" if optional else f"start: tc{'+' if parallel else ''}"
        return f"{start}\ntc: <[{ids[0]}]> CODE <[{ids[1]}]>\nCODE: /[^\\n]{{1,{CALCULATOR_CODE_CHARS}}}/\n"


NANOCHAT = Nanochat()
