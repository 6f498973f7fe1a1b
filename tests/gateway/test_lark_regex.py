"""Lark grammars rewritten as one regex (gateway/lark_regex.py), checked against llguidance.

llguidance's own Lark reader is the independent judge: for every sample, the rewritten regex
(through llguidance's regex compiler and through Python's ``re``) and the original grammar
(through llguidance's Lark compiler) must agree on acceptance.
"""

from __future__ import annotations

import re

import llguidance as llg
import pytest

from gateway.lark_regex import escape, to_regex

BYTES = llg.LLTokenizer("byte")

# A patch format like the one coding agents send as a freeform tool's grammar.
PATCH = r'''
// a patch: one or more file operations between the markers
start: "*** Begin Patch" LF operation+ "*** End Patch" LF?
operation: add_file | delete_file | update_file
add_file: "*** Add File: " path LF added+
delete_file: "*** Delete File: " path LF
update_file: "*** Update File: " path LF rename? hunk?
rename: "*** Move to: " path LF
hunk: (header | changed)+ end_of_file?
header: ("@@" | "@@ " /(.+)/) LF
changed: ("+" | "-" | " ") /(.*)/ LF
end_of_file: "*** End of File" LF
added: "+" /(.*)/ LF -> line
path: /(.+)/
%import common.LF
'''
PATCH_SAMPLES = [
    ("*** Begin Patch\n*** Add File: a.py\n+x = 1\n+\n*** End Patch\n", True),
    (("*** Begin Patch\n*** Update File: b.txt\n*** Move to: c.txt\n@@ def f\n-a\n+b\n c\n*** End of File\n"
      "*** End Patch"), True),
    ("*** Begin Patch\n*** Delete File: x\n*** Update File: y\n*** End Patch", True),
    ("*** Begin Patch\n*** End Patch", False),  # no operation
    ("*** Begin Patch\n*** Add File: a.py\n*** End Patch\n", False),  # an added file needs lines
    ("*** Begin Patch\n*** Add File: a.py\nx = 1\n*** End Patch\n", False),  # a line without "+"
    ("*** Begin Patch\n*** Delete File: x\n*** End Patch\n\n", False),  # one trailing line break at most
]

SMALL = [
    # (grammar, samples that must agree)
    ('start: "a" ("b" | "c")* "d"?', ["a", "abcbd", "ad", "abd", "da", "abdd"]),
    ('start: x{2,3}\nx: "ab"', ["ab", "abab", "ababab", "abababab"]),
    ('start: "x" [y] z+\ny: "-"\nz: "0".."9"', ["x1", "x-12", "x-", "x", "xa"]),
    ('start: "Yes"i | "no"', ["yes", "YES", "No", "no", "nope"]),
    ('start: WORD (WS_INLINE WORD)*\n%import common (WORD, WS_INLINE)', ["one", "one two", "one  two", "one2"]),
    ('start: /[a-c]+/i "."', ["aBc.", "ab", "d."]),
    ('start: a\n    | b\na: "1"\nb: "2" "3"  // a comment', ["1", "23", "2", "13"]),
    ('start: "a\\tb" "\\"q\\""', ['a\tb"q"', "a b\"q\""]),
    ('start: "[x]" "+" "(y)"', ["[x]+(y)", "x+y"]),
]

NOT_REWRITTEN = [
    "start: item\nitem: \"(\" item \")\" | \"x\"",  # a rule that reaches itself
    "start: list\nlist: \"a\" | list \",\" \"a\"",  # left recursion
    'start: "a" WS "b"\n%import common.WS\n%ignore WS',
    'start: %json {"type": "object"}',
    "start: <tool_call> \"x\"",
    "start: pair{\"a\"}\npair{x}: x x",  # a template
    'start: "a"\n%import other.X',
    'start: "a"\n%import common.UNKNOWN_THING',
    'start: missing',
    'other: "a"',  # no start rule
    'start: "a" (',
    'start: /[a-z]+/x',  # a flag not read
]


def accepts(grammar: str, text: str) -> bool:
    matcher = llg.LLMatcher(BYTES, grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def agree(lark: str, samples: list[str]) -> None:
    regex = to_regex(lark)
    assert regex is not None, lark
    by_lark = llg.LLMatcher.grammar_from_lark(lark)
    by_regex = llg.LLMatcher.grammar_from_regex(regex)
    assert llg.LLMatcher.validate_grammar(by_regex, BYTES) == "", regex
    for text in samples:
        expected = accepts(by_lark, text)
        assert accepts(by_regex, text) == expected, (lark, regex, text)
        assert (re.fullmatch(regex, text) is not None) == expected, (lark, regex, text)


def test_a_patch_grammar_is_rewritten_and_agrees_with_llguidance():
    agree(PATCH, [text for text, _ in PATCH_SAMPLES])
    regex = to_regex(PATCH)
    for text, valid in PATCH_SAMPLES:
        assert (re.fullmatch(regex, text) is not None) == valid, text


@pytest.mark.parametrize("lark, samples", SMALL, ids=range(len(SMALL)))
def test_each_construct_agrees_with_llguidance(lark, samples):
    agree(lark, samples)


@pytest.mark.parametrize("lark", NOT_REWRITTEN, ids=range(len(NOT_REWRITTEN)))
def test_what_is_not_regular_or_not_read_is_left_alone(lark):
    assert to_regex(lark) is None


def test_a_priority_is_read_past():
    # llguidance refuses rule priorities, Lark itself orders its lexer by them; the language is
    # the same either way
    assert to_regex('start: a | b\na: "1"\nB.2: "2"\nb: B') == "(?:(?:1)|(?:(?:2)))"


def test_escape_writes_literals_the_rust_syntax_reads():
    text = "a.b*c? (d) [e] {f} ^g$ h|i \\ # & - ~ \t\n\x01 é"
    pattern = escape(text)
    assert escape(" ") == " "  # an escaped space is an error in the Rust syntax
    assert re.fullmatch(pattern, text)
    assert accepts(llg.LLMatcher.grammar_from_regex(pattern), text)
