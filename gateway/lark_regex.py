"""A Lark grammar without recursion, rewritten as one regular expression.

A Codex ``custom`` tool (apply_patch is one) carries a Lark grammar for its input. When the tool
is forced, the whole reply is that input and the worker holds it to the grammar directly. Under
``tool_choice: auto`` the input travels inside a Hermes call, as the JSON string
``arguments.input``; llguidance can hold a JSON string to a regular expression (a schema
``pattern``, matched against the string's decoded characters), not to a Lark grammar. Most tool
grammars, apply_patch's among them, describe a regular language: no rule reaches itself. Those
are rewritten here by inlining every rule and terminal into a single regex.

What is read is the Lark subset tool grammars use: rules and terminals (priorities ignored),
alternatives with ``-> alias``, groups, ``[optional]``, ``? * +``, ``{n}`` / ``{m,n}`` and
``~ n..m`` repeats, ``"literals"`` (with the ``i`` flag), ``"a".."z"`` ranges, ``/regexes/flags``,
and ``%import common.NAME`` for the common terminals listed in ``COMMON``. Anything else (a rule
that reaches itself, ``%ignore``, templates, llguidance's ``%json``, special tokens, ``&`` and
``~`` on terminals) makes ``to_regex`` return None: the grammar is not rewritten, and the caller
leaves the input free.

The regex accepts every sentence of the grammar. Lark's lexer matches terminals greedily, so a
grammar can be stricter than its regex in corner cases (a terminal that could end early); the
regex never refuses what the grammar accepts.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

# Lark's common.lark terminals, as regexes (only those a tool grammar plausibly imports).
COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)",
    "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*", "ESCAPED_STRING": r'"(?:[^"\\\n]|\\.)*"',
}

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+|\\\n)
  | (?P<newline>\n)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<directive>%[a-z_]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_A-Za-z][_A-Za-z0-9]*)
  | (?P<number>[0-9]+)
  | (?P<op>[:|()\[\]?*+,~{}.<>@&!])
""", re.VERBOSE)

# Characters a regex must escape (also those the Rust regex syntax llguidance uses reserves).
_META = set(r"\.+*?()|[]{}^$#&-~")


class NotRegular(Exception):
    """The grammar uses something this rewrite does not read, or is not a regular language."""


def to_regex(grammar: str) -> str | None:
    """The grammar's start rule as one regex (no anchors), or None when it cannot be rewritten."""
    try:
        definitions = _Reader(_tokens(grammar)).definitions()
        if "start" not in definitions:
            return None
        return _Inliner(definitions).regex("start")
    except (NotRegular, ValueError, SyntaxError, RecursionError):
        return None


def escape(text: str) -> str:
    """A literal as regex text, escaping only what is special (an escaped space is an error in
    the Rust regex syntax) and writing control characters as escapes."""
    out = []
    for char in text:
        if char in _META:
            out.append("\\" + char)
        elif char == "\n":
            out.append(r"\n")
        elif char == "\t":
            out.append(r"\t")
        elif char == "\r":
            out.append(r"\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(rf"\x{ord(char):02x}")
        else:
            out.append(char)
    return "".join(out)


# --- reading the grammar -------------------------------------------------------------------------

@dataclass
class _Token:
    kind: str
    text: str


def _tokens(grammar: str) -> list[_Token]:
    out: list[_Token] = []
    position = 0
    while position < len(grammar):
        match = _TOKEN.match(grammar, position)
        if match is None:
            raise NotRegular(f"unreadable text at {position}")
        kind = match.lastgroup or ""
        if kind not in ("space", "comment"):
            out.append(_Token(kind, match.group()))
        position = match.end()
    out.append(_Token("newline", "\n"))
    out.append(_Token("end", ""))
    return out


# A parsed expression: ("seq", [...]), ("alt", [...]), ("repeat", item, low, high or None),
# ("lit", regex text), ("ref", name).
Node = tuple


class _Reader:
    def __init__(self, tokens: list[_Token]):
        self.tokens = tokens
        self.at = 0

    def peek(self, offset: int = 0) -> _Token:
        return self.tokens[min(self.at + offset, len(self.tokens) - 1)]  # the last is "end"

    def take(self, kind: str, text: str | None = None) -> _Token:
        token = self.peek()
        if token.kind != kind or (text is not None and token.text != text):
            raise NotRegular(f"expected {text or kind}, found {token.text!r}")
        self.at += 1
        return token

    def accept(self, kind: str, text: str | None = None) -> bool:
        token = self.peek()
        if token.kind == kind and (text is None or token.text == text):
            self.at += 1
            return True
        return False

    def skip_newlines(self) -> None:
        while self.accept("newline"):
            pass

    def definitions(self) -> dict[str, Node]:
        found: dict[str, Node] = {}
        self.skip_newlines()
        while self.peek().kind != "end":
            token = self.peek()
            if token.kind == "directive":
                self.directive(found)
            else:
                name = self.take("name").text
                if self.accept("op", "."):  # a priority: it orders the lexer, the language stays
                    self.take("number")
                self.take("op", ":")
                if name in found:
                    raise NotRegular(f"{name} is defined twice")
                found[name] = self.alternatives()
            self.take("newline")
            self.skip_newlines()
        return found

    def directive(self, found: dict[str, Node]) -> None:
        word = self.take("directive").text
        if word != "%import":
            raise NotRegular(f"{word} is not read")
        module = self.take("name").text
        if module != "common":
            raise NotRegular(f"only common terminals are read, not {module}")
        names: list[str] = []
        if self.accept("op", "."):
            names.append(self.take("name").text)
            if self.accept("arrow"):
                raise NotRegular("renamed imports are not read")
        else:
            self.take("op", "(")
            names.append(self.take("name").text)
            while self.accept("op", ","):
                names.append(self.take("name").text)
            self.take("op", ")")
        for name in names:
            if name not in COMMON:
                raise NotRegular(f"common.{name} is not known here")
            found[name] = ("lit", COMMON[name])

    def alternatives(self) -> Node:
        options = [self.alias()]
        while True:
            # an alternative may continue on the next line, starting with "|"
            ahead = 0
            while self.peek(ahead).kind == "newline":
                ahead += 1
            if self.peek(ahead).kind == "op" and self.peek(ahead).text == "|":
                self.at += ahead + 1
                options.append(self.alias())
            else:
                break
        return options[0] if len(options) == 1 else ("alt", options)

    def alias(self) -> Node:
        sequence = self.sequence()
        if self.accept("arrow"):
            self.take("name")
        return sequence

    def sequence(self) -> Node:
        items = []
        while True:
            token = self.peek()
            if token.kind in ("string", "regex", "name") or (token.kind == "op" and token.text in "([" ):
                items.append(self.repeated())
            else:
                break
        return items[0] if len(items) == 1 else ("seq", items)

    def repeated(self) -> Node:
        item = self.atom()
        token = self.peek()
        if token.kind == "op" and token.text in "?*+":
            self.at += 1
            return ("repeat", item, 0 if token.text != "+" else 1, 1 if token.text == "?" else None)
        if self.accept("op", "~"):
            low = int(self.take("number").text)
            high = int(self.take("number").text) if self.accept("range") else low
            return ("repeat", item, low, high)
        if self.accept("op", "{"):
            low = int(self.take("number").text)
            high: int | None = low
            if self.accept("op", ","):
                high = int(self.take("number").text) if self.peek().kind == "number" else None
            self.take("op", "}")
            return ("repeat", item, low, high)
        return item

    def atom(self) -> Node:
        token = self.peek()
        if self.accept("op", "("):
            inner = self.alternatives()
            self.take("op", ")")
            return inner
        if self.accept("op", "["):
            inner = self.alternatives()
            self.take("op", "]")
            return ("repeat", inner, 0, 1)
        if self.accept("string"):
            first = _literal(token.text)
            if self.accept("range"):
                last = _literal(self.take("string").text)
                if len(first[0]) != 1 or len(last[0]) != 1:
                    raise NotRegular("a range joins two single characters")
                return ("lit", f"[{escape(first[0])}-{escape(last[0])}]")
            text, insensitive = first
            return ("lit", f"(?i:{escape(text)})" if insensitive else escape(text))
        if self.accept("regex"):
            body, flags = token.text[1:].rsplit("/", 1)
            body = body.replace("\\/", "/")
            if set(flags) - set("is"):
                raise NotRegular(f"regex flags {flags!r} are not read")
            return ("lit", f"(?{flags}:{body})" if flags else f"(?:{body})")
        if self.accept("name"):
            if self.peek().text == "{" and self.peek(1).kind != "number":  # name{3} repeats
                raise NotRegular("templates are not read")
            return ("ref", token.text)
        raise NotRegular(f"unexpected {token.text!r}")


def _literal(token: str) -> tuple[str, bool]:
    insensitive = token.endswith("i")
    text = ast.literal_eval(token[:-1] if insensitive else token)
    if not isinstance(text, str) or not text:
        raise NotRegular("an empty literal")
    return text, insensitive


# --- writing the regex --------------------------------------------------------------------------

class _Inliner:
    def __init__(self, definitions: dict[str, Node]):
        self.definitions = definitions
        self.done: dict[str, str] = {}
        self.open: set[str] = set()

    def regex(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.open:
            raise NotRegular(f"{name} reaches itself")
        if name not in self.definitions:
            raise NotRegular(f"{name} is not defined")
        self.open.add(name)
        text = self.node(self.definitions[name])
        self.open.discard(name)
        self.done[name] = text
        return text

    def node(self, node: Node) -> str:
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind == "ref":
            return f"(?:{self.regex(node[1])})"
        if kind == "seq":
            return "".join(self.node(item) for item in node[1])
        if kind == "alt":
            return "(?:" + "|".join(self.node(option) for option in node[1]) + ")"
        _, item, low, high = node
        inner = f"(?:{self.node(item)})"
        if (low, high) == (0, 1):
            return inner + "?"
        if (low, high) == (0, None):
            return inner + "*"
        if (low, high) == (1, None):
            return inner + "+"
        return inner + (f"{{{low},}}" if high is None else f"{{{low},{high}}}" if high != low else f"{{{low}}}")
