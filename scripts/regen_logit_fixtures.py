"""Regenerate the reference-logit fixtures for the numpy engine's parity tests.

How to regenerate (from the repo root, in a venv with llama-cpp-python, gguf, tokenizers and
numba; the last two because tests/qwen_vocab.py builds the Qwen vocabulary through
shared.tokenizer and tests/tiny_models.py reads the architectures' declarations). The bindings
may also come from the llama-cpp-python sdist tree with a llama.cpp built apart from it:
``PYTHONPATH=SDIST LLAMA_CPP_LIB_PATH=BUILD/bin LD_LIBRARY_PATH=BUILD/bin``.

    /work/peer-venv/bin/python scripts/regen_logit_fixtures.py            # every fixture
    /work/peer-venv/bin/python scripts/regen_logit_fixtures.py llama_tiny # just some

llama-cpp-python builds llama.cpp natively; with GCC 12 on a CPU with AMX the build must pass
``-mno-amx-int8`` (CMAKE_ARGS with the C and C++ flags) or quantized matmuls die with SIGILL.

What it writes, one ``tests/fixtures/logits_<name>.npz`` per model:

* ``llama_tiny``, ``qwen3_tiny``, ``qwen3moe_tiny``: the tiny random-weight GGUFs of
  ``tests/tiny_models.py`` (rewritten here from their fixed seeds, so models and fixtures stay
  in step), fed 40 fixed token ids.
* ``gemma3_270m``: Gemma 3 270M on ~200 tokens of plain text, on an F32 copy as for smollm2,
  with the Q4_K_M file's own greedy continuation of a short prompt.
* ``smollm2``: SmolLM2-135M-Instruct on a ChatML prompt, evaluated on an F32 copy of the Q4_1
  file (every tensor dequantized with ``gguf.quants.dequantize``), because llama.cpp rounds
  activations to 8 bits when it multiplies by Q4_1 weights; the F32 copy is what an exact
  dequantize-then-f32 engine should match.

Each file holds ``tokens`` [T], and per position ``top1`` [T], ``top_ids`` / ``top_logits``
[T, 20] (descending), ``logsumexp`` [T] over the full vocabulary (so tests can compare
log-probabilities), and ``meta``: a JSON string with the reference used (llama.cpp version),
the evaluation parameters, how to rebuild the model (``write_tiny_gguf`` arguments or the source
file) and the model file's sha256. ``smollm2`` also holds ``greedy_ids``: llama.cpp's argmax
continuation of the prompt.

llama.cpp runs with F32 KV cache, flash attention off, one batch holding the whole sequence and
two threads, so the reference differs from exact arithmetic only by f32 rounding.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repo root for worker/ and shared/; tests/ itself (not the ``tests`` namespace package,
# which a stray installed ``tests`` package could shadow) for tiny_models.
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

import gguf  # noqa: E402
import llama_cpp  # noqa: E402
from fixture_files import TOP_K, save_fixture, sha256_of  # noqa: E402
import tiny_models  # noqa: E402

from shared.default_model import cache_dir, default_model_path, model_path  # noqa: E402

TINY_SEED = 0
TINY_TOKEN_SEED = 1234
TINY_TOKEN_COUNT = 40
GREEDY_STEPS = 12

SMOLLM2_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhich city is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# Gemma 3 270M is a base model: plain text, about 200 tokens of it, and a greedy continuation.
GEMMA3_PROMPT = "The Eiffel Tower is located in the city of"
GEMMA3_TEXT = (
    "The Eiffel Tower is located in the city of Paris. Built for the world's fair of 1889, it was "
    "meant to stand for twenty years and was nearly taken down, until its height proved useful for "
    "radio. Today it is painted every seven years, by hand, with about sixty tonnes of paint.\n\n"
    "A river runs through the middle of the city, and more than thirty bridges cross it. The oldest "
    "of them, despite its name, is the Pont Neuf. Markets line the banks in the morning; by evening "
    "the quays fill with people who read, talk, eat and watch the boats go by.\n\n"
    "def area(radius: float) -> float:\n    return 3.14159 * radius ** 2\n\n"
    "In 2024 the city hosted the Summer Olympic Games, and swimmers raced in the river for the first "
    "time in a century."
)

# every registered architecture and the variants with fixtures of their own
TINY_MODELS = {f"{name}_tiny": spec for name, spec in tiny_models.TINY_FIXTURES.items()}
ALL_NAMES = [*TINY_MODELS, "smollm2", "gemma3_270m"]

# One context, one batch holding every token, f32 everywhere llama.cpp would otherwise round
# (the KV cache defaults to f16), no flash attention (its tiled softmax sums in another order).
LLAMA_PARAMS: dict[str, Any] = {
    "n_ctx": 256,
    "n_batch": 512,
    "n_ubatch": 512,
    "n_threads": 2,
    "n_threads_batch": 2,
    "flash_attn": False,
    "type_k": 0,  # GGML_TYPE_F32
    "type_v": 0,
    "logits_all": True,
    "seed": 0,
}


def llama_cpp_version() -> str:
    # The bindings expose no llama.cpp commit; the bundled ggml's soname version and the CPU
    # feature line (which shows whether the AMX int8 path was built) pin the build instead.
    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    ggml = sorted(p.name.removeprefix("libggml-base.so.") for p in lib_dir.glob("libggml-base.so.*.*"))
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return (f"llama-cpp-python {llama_cpp.__version__} (bundled llama.cpp, ggml "
            f"{ggml[-1] if ggml else 'unknown'}); {system_info}")


def open_llama(model_path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(model_path), verbose=False, **LLAMA_PARAMS)


def reference_logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    """Logits [T, n_vocab] for every position of ``tokens``, evaluated from an empty cache."""
    if len(tokens) > LLAMA_PARAMS["n_batch"]:
        raise ValueError("the sequence must fit one batch so llama.cpp evaluates it in one pass")
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32, copy=True)


def base_meta(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "reference": "llama.cpp",
        "reference_version": llama_cpp_version(),
        "gguf_package_version": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "params": dict(LLAMA_PARAMS),
        "eval": "one llama_cpp.Llama.eval() of the whole token list from an empty cache",
        "top_k": TOP_K,
    }


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def tiny_fixture(name: str, arch: str, overrides: dict[str, Any], scratch: Path) -> None:
    print(f"{name}:")
    info = tiny_models.write_tiny_gguf(scratch / f"{name}.gguf", arch, seed=TINY_SEED, **overrides)
    model_path = Path(info["path"])
    rng = np.random.default_rng(TINY_TOKEN_SEED)
    tokens = [int(t) for t in rng.integers(0, info["n_vocab"], size=TINY_TOKEN_COUNT)]
    llm = open_llama(model_path)
    try:
        logits = reference_logits(llm, tokens)
    finally:
        llm.close()
    meta = base_meta(name)
    meta["model"] = {
        "kind": "tiny_models.write_tiny_gguf",
        "arch": arch,
        "seed": TINY_SEED,
        "overrides": overrides,
        "hparams": {k: v for k, v in info.items() if k not in ("path", "tensor_shapes")},
        "sha256": sha256_of(model_path),
    }
    meta["tokens"] = {"kind": "numpy default_rng integers", "seed": TINY_TOKEN_SEED,
                      "count": TINY_TOKEN_COUNT}
    save_fixture(name, tokens, logits, meta)


def write_f32_copy(source: Path, target: Path) -> None:
    """Rewrite ``source`` with every tensor dequantized to F32 and all metadata kept."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        # GGUF.* are the reader's view of the header; the writer adds the architecture itself.
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, main_type, sub_type)
    for tensor in reader.tensors:
        numpy_shape = tuple(int(d) for d in reversed(tensor.shape))
        data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data.reshape(numpy_shape), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def f32_copy_meta(kind: str, source: Path, f32_path: Path) -> dict[str, Any]:
    return {
        "kind": kind,
        "source_file": source.name,
        "source_sha256": sha256_of(source),
        "evaluated_file": "every tensor of the source dequantized with gguf.quants.dequantize, "
                          "stored F32, metadata unchanged except general.file_type",
        "sha256": sha256_of(f32_path),
    }


def greedy_continuation(llm: llama_cpp.Llama, prompt: list[int], steps: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        if token == llm.token_eos():
            break
        llm.eval([token])
    return out


def smollm2_fixture(scratch: Path) -> None:
    print("smollm2:")
    source = default_model_path()
    f32_path = scratch / "SmolLM2-135M-Instruct.F32.gguf"
    write_f32_copy(source, f32_path)

    llm = open_llama(f32_path)
    try:
        tokens = llm.tokenize(SMOLLM2_PROMPT.encode(), add_bos=False, special=True)
        logits = reference_logits(llm, tokens)
        greedy = greedy_continuation(llm, tokens, GREEDY_STEPS)
        greedy_text = llm.detokenize(greedy).decode(errors="replace")
    finally:
        llm.close()
    print(f"  F32 copy greedy: {greedy} {greedy_text!r}")

    # The Q4_1 file itself is not the fixture (see the docstring); its continuation is
    # printed only to show how far llama.cpp's quantized path drifts from the F32 one.
    q_llm = open_llama(source)
    try:
        q_greedy = greedy_continuation(q_llm, tokens, GREEDY_STEPS)
        print(f"  Q4_1 greedy:     {q_greedy} {q_llm.detokenize(q_greedy).decode(errors='replace')!r}")
    finally:
        q_llm.close()

    meta = base_meta("smollm2")
    meta["model"] = f32_copy_meta("f32 copy of the default model", source, f32_path)
    meta["tokens"] = {"kind": "llama.cpp tokenize(special=True, add_bos=False)",
                      "prompt": SMOLLM2_PROMPT}
    meta["greedy_text"] = greedy_text
    save_fixture("smollm2", tokens, logits, meta, {"greedy_ids": np.asarray(greedy, np.int32)})


def gemma3_fixture(scratch: Path) -> None:
    """Gemma 3 270M (real weights) on ~200 tokens of text, evaluated on an F32 copy of the
    Q4_K_M file for the same reason as smollm2; plus the greedy continuation of GEMMA3_PROMPT
    by the Q4_K_M file itself, which the served (quantized) path is held to."""
    print("gemma3_270m:")
    source = model_path("gemma-3-270m")
    f32_path = scratch / "gemma-3-270m.F32.gguf"
    write_f32_copy(source, f32_path)
    llm = open_llama(f32_path)
    try:
        tokens = llm.tokenize(GEMMA3_TEXT.encode(), add_bos=True, special=False)
        logits = reference_logits(llm, tokens)
    finally:
        llm.close()
    q_llm = open_llama(source)
    try:
        prompt = q_llm.tokenize(GEMMA3_PROMPT.encode(), add_bos=True, special=False)
        greedy = greedy_continuation(q_llm, prompt, GREEDY_STEPS)
        greedy_text = q_llm.detokenize(greedy).decode(errors="replace")
    finally:
        q_llm.close()
    print(f"  Q4_K_M greedy: {greedy} {greedy_text!r}")
    meta = base_meta("gemma3_270m")
    meta["model"] = f32_copy_meta("f32 copy of gemma-3-270m (lmserve's known model)", source, f32_path)
    meta["tokens"] = {"kind": "llama.cpp tokenize(special=False, add_bos=True)", "text": GEMMA3_TEXT}
    meta["greedy"] = {"file": source.name, "prompt": GEMMA3_PROMPT, "text": greedy_text}
    save_fixture("gemma3_270m", tokens, logits, meta,
                 {"greedy_prompt_ids": np.asarray(prompt, np.int32), "greedy_ids": np.asarray(greedy, np.int32)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*",
                        help=f"fixtures to rebuild (default: all of {', '.join(ALL_NAMES)})")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where to write the model files (default: a temporary directory "
                             "under the lmserve cache; the F32 SmolLM2 copy is ~540 MB)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(ALL_NAMES))
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; choose from {ALL_NAMES}")
    names = args.names or ALL_NAMES
    print(llama_cpp_version())

    scratch_parent = args.scratch or cache_dir()
    scratch_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="logit-fixtures-", dir=scratch_parent) as scratch:
        for name in names:
            if name in TINY_MODELS:
                tiny_fixture(name, *TINY_MODELS[name], Path(scratch))
            elif name == "gemma3_270m":
                gemma3_fixture(Path(scratch))
            else:
                smollm2_fixture(Path(scratch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
