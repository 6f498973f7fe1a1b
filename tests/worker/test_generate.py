"""``lmserve generate`` end to end on a tiny model: the scheduler's loop, its stop rules and refusals."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from tiny_models import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=3)  # a 256-token context
    return path


def _generate(model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", "generate", str(model), *args],
                          capture_output=True, text=True, timeout=300)


def test_a_raw_prompt_runs_to_max_tokens_and_reports_the_speeds(tiny):
    done = _generate(tiny, "--prompt", "one two three", "--raw", "--max-tokens", "6", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    report = re.search(r"\[(\d+) prompt tokens at [\d.]+ tok/s prefill; (\d+) completion tokens at [\d.]+ tok/s "
                       r"decode; finish: (\w+)\]", done.stderr)
    assert report, done.stderr
    prompt_tokens, completion_tokens, finish = int(report[1]), int(report[2]), report[3]
    assert prompt_tokens > 0
    # a random tiny model may sample its end-of-turn token before the sixth: then it stops there
    assert (completion_tokens, finish) == (6, "length") or (completion_tokens <= 6 and finish == "stop")


def test_a_prompt_beyond_the_context_is_refused_with_the_reason(tiny):
    done = _generate(tiny, "--prompt", " ".join(["word"] * 400), "--raw", "--max-tokens", "4")
    assert done.returncode == 2
    assert "prompt is too long" in done.stderr


def test_a_diffusion_model_writes_its_blocks_and_reports_tokens_per_second(tmp_path):
    path = tmp_path / "diffusion-gemma.gguf"
    write_tiny_gguf(path, "diffusion-gemma")  # canvases of 8
    done = _generate(path, "--prompt", "one two three", "--raw", "--max-tokens", "12", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    report = re.search(r"(\d+) completion tokens at ([\d.]+) tok/s decode; finish: (\w+)\]", done.stderr)
    assert report, done.stderr
    # two blocks, 8 and 4 tokens (the rate is the second's over its time): greedy on these weights
    # samples no end of turn in them, so the run always reaches max_tokens
    assert (int(report[1]), report[3]) == (12, "length"), done.stderr
    assert float(report[2]) > 0, done.stderr
