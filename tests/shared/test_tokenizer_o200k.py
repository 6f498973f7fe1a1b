"""The o200k pre-tokenizer (GPT-4o, Llama 4, Inkling), checked against the split its models
ship: the regex as written in their tokenizer.json, run by the ``tokenizers`` library itself."""

from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers

from shared.tokenizer import PRE_KINDS, PRE_NAMES

# As the Hugging Face tokenizer.json of these models writes it (its (?i:...) is spelled out in
# ours, as every kind here spells it).
ORIGINAL = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = [
    "Hello world, it's 2024!",
    "HELLO World's END'LL be fine; THEY'RE here, I'M sure, we'Ve seen",
    "CamelCaseWords and snake_case_words and kebab-case-words",
    "1234567890 12 123 1,000,000.25",
    "naïve café  déjà vu: the cafe\u0301 (e + U+0301)",
    "नमस्ते दुनिया, और हिन्दी में",
    "Ελληνικά ΚΕΦΑΛΑΙΑ και μικρά; Кириллица ПРОПИСНЫЕ",
    "中文没有空格。日本語のテキスト、カタカナ",
    "path/to/file.py\nline two\r\n\r\n\tindented    spaces   \n\n",
    "a = b // c /* comment */ x /= 2;\n// trailing//\n",
    "emoji 👍🏽 and 🇫🇷 flags… «quotes» “curly” — dash",
    "   leading spaces and trailing   ",
    "'s 'S 'T 're 'RE 've 'M 'll 'LL 'd 'D don't DON'T o'clock",
]


def splits(pattern: str, text: str) -> list[str]:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


def o200k(text: str) -> list[str]:
    [pattern] = PRE_KINDS["o200k"].splits
    return splits(pattern, text)


@pytest.mark.parametrize("name", ["inkling", "gpt-4o", "llama4"])
def test_the_names_map_to_o200k(name):
    assert PRE_NAMES[name] == "o200k"


@pytest.mark.parametrize("text", TEXTS)
def test_pre_tokens_match_the_original_regex(text):
    expected = splits(ORIGINAL, text)
    assert o200k(text) == expected
    assert "".join(expected) == text


def test_a_word_with_combining_marks_is_one_pre_token():
    # "café" written with a combining acute, and Devanagari's vowel signs (marks, not letters)
    assert o200k("the cafe\u0301 is") == ["the", " cafe\u0301", " is"]
    assert o200k("नमस्ते") == ["नमस्ते"]


def test_digits_split_in_threes():
    assert o200k("1234567") == ["123", "456", "7"]
    assert o200k("x 12345") == ["x", " ", "123", "45"]


def test_case_changes_and_contractions():
    assert o200k("CamelCase") == ["Camel", "Case"]
    assert o200k("HTTPServer") == ["HTTPServer"]
    assert o200k("DON'T don't") == ["DON'T", " don't"]
    assert o200k("a/b//c\n") == ["a", "/b", "//", "c", "\n"]
