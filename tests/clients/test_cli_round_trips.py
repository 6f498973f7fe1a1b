"""The real Claude Code and Codex CLIs against a served stack: one tool round trip each, run as
README.md's "Use it with…" recipes say (their variables, configuration and command lines are read
from there).

.ci/run installs both from npm at pinned versions into .ci/node (git-ignored); a test skips,
saying how to install its CLI, only when that CLI is not there. ``pytest tests/clients`` selects
these tests.

The model is the tiny random qwen3 (the real Qwen vocabulary, the Hermes ``<tool_call>``
convention) behind ``--scripted-replies``. Each CLI's prompt carries a marker whose reply calls
the CLI's own shell tool; the command writes and prints a second marker that appears nowhere in
the call (the shell computes it: ``$((6*7))``), and the reply keyed to that marker is the CLI's
final answer. So the answer the CLI prints proves that it ran the tool and sent its output back
in the next request. Each CLI runs with a HOME (and CODEX_HOME) of its own in a temporary folder,
none of the machine's environment but PATH, and the settings that keep it from calling anything
but the gateway.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from access_logs import access_entries
from readme_recipes import LOCAL_URL, blocks, command, exported
from tiny_models import write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
CLIS = REPO / ".ci" / "node" / "node_modules" / ".bin"  # where .ci/run installs them
CONTEXT = 32768  # Claude Code's first request alone is ~12k tokens here
CLAUDE_RECIPE = blocks("sh", "ANTHROPIC_BASE_URL")[0]
CODEX_RECIPE = blocks("sh", "codex exec")[0]
API_KEY = exported(CLAUDE_RECIPE)["ANTHROPIC_API_KEY"]  # the server's key in the recipes
CLI_TIMEOUT = 600  # seconds; the first request's prefill is most of it


def shell_call(tool: str, argument: str, line: str, **extra: str) -> str:
    """A Hermes call of a CLI's shell tool running the command ``line``."""
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": {argument: line, **extra}}) + "\n</tool_call>"


def proof_command(tag: str) -> str:
    """Writes and prints ``<tag>-42-done``, a text that only running it produces."""
    return f"echo {tag}-$((6*7))-done > proof.txt && cat proof.txt"


CLAUDE_ANSWER = "The proof file says cc-42-done."
CODEX_ANSWER = "The proof file says cx-42-done."
SCRIPT: list[dict[str, Any]] = [
    # Claude Code's shell tool is Bash {command, description}
    {"when": "[[claude-code-round-trip]]",
     "text": shell_call("Bash", "command", proof_command("cc"), description="Write the proof file")},
    {"when": "cc-42-done", "text": CLAUDE_ANSWER},
    # Codex 0.169's is exec_command {cmd, ...}
    {"when": "[[codex-round-trip]]", "text": shell_call("exec_command", "cmd", proof_command("cx"))},
    {"when": "cx-42-done", "text": CODEX_ANSWER},
    # anything else a CLI asks on the side gets a plain answer
    {"text": "There is no script for this."},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_worker, start_gateway):
    """A gateway (API key, JSON access log) before a scripted tiny qwen3 worker."""
    folder = tmp_path_factory.mktemp("cli-round-trips")
    model = folder / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=CONTEXT)
    script = folder / "replies.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    worker = start_worker(model, "--scripted-replies", str(script), "--ctx", str(CONTEXT))
    return start_gateway(worker, "--api-key", API_KEY, "--log-format", "json", "--ping-interval", "0.5")


def installed(name: str) -> Path:
    path = CLIS / name
    if not path.exists():
        pytest.skip(f"the {name} CLI is not installed in {CLIS.parent.parent}: .ci/run installs it "
                    "(npm install --prefix .ci/node @anthropic-ai/claude-code@… @openai/codex@…)")
    return path


def run_cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The CLI run as a user would in a terminal-less script: no input, nothing of the machine's
    environment but PATH (no ANTHROPIC_*, OPENAI_* or CODEX_* setting of the machine leaks in)."""
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **env}
    done = subprocess.run(args, cwd=cwd, env=environment, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=CLI_TIMEOUT)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


def requests_since(gateway, seen: int) -> list[dict[str, Any]]:
    """The gateway's access-log entries after the first ``seen``."""
    return access_entries(gateway.log_path)[seen:]


def assert_round_trip(entries: list[dict[str, Any]], path: str) -> None:
    """Everything the CLI sent was answered, and its conversation went call, then answer."""
    assert entries, "the CLI sent the gateway nothing"
    assert all(entry["status"] == 200 for entry in entries), [(e["method"], e["path"], e["status"]) for e in entries]
    finishes = [entry["finish"] for entry in entries if entry["path"] == path]
    assert "tool_calls" in finishes and finishes[-1] == "stop", finishes


def test_claude_code_runs_a_scripted_bash_call_and_answers_from_its_output(served, tmp_path):
    claude = installed("claude")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    args = command(CLAUDE_RECIPE, "claude")  # claude -p PROMPT --allowedTools Bash
    args[0], args[args.index("-p") + 1] = str(claude), "Write the proof file. [[claude-code-round-trip]]"
    env = {**exported(CLAUDE_RECIPE), "ANTHROPIC_BASE_URL": served.url, "HOME": str(home),
           # implied by the recipe's CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC; said outright all the same
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1"}
    seen = len(access_entries(served.log_path))
    done = run_cli(args, work, env)
    assert (work / "proof.txt").read_text().strip() == "cc-42-done"  # the Bash call ran
    # the answer keyed to the command's output: the second request carried the tool result
    assert CLAUDE_ANSWER in done.stdout
    assert_round_trip(requests_since(served, seen), "/v1/messages")


def codex_config(url: str) -> str:
    """The README's config.toml for a server at ``url``, plus what keeps a test quick to fail and
    off the network: no retries, no update check, no plugin sync (which looks up GitHub), no
    analytics."""
    recipe = blocks("toml", "wire_api")[0].replace(LOCAL_URL, url)
    provider = "[model_providers.lmserve]\n"
    assert provider in recipe
    recipe = recipe.replace(provider, provider + "request_max_retries = 0\nstream_max_retries = 0\n")
    return ("check_for_update_on_startup = false\n" + recipe
            + "\n\n[features]\nplugins = false\n\n[analytics]\nenabled = false\n")


def test_codex_runs_a_scripted_exec_command_call_and_answers_from_its_output(served, tmp_path):
    codex = installed("codex")
    home, codex_home, work = tmp_path / "home", tmp_path / "codex", tmp_path / "work"
    for folder in (home, codex_home, work):
        folder.mkdir()
    (codex_home / "config.toml").write_text(codex_config(served.url), encoding="utf-8")
    # codex exec --sandbox workspace-write PROMPT; the test's folder is no git repository
    args = [str(codex), *command(CODEX_RECIPE, "codex")[1:-1], "--skip-git-repo-check",
            "Write the proof file. [[codex-round-trip]]"]
    seen = len(access_entries(served.log_path))
    done = run_cli(args, work, {**exported(CODEX_RECIPE), "HOME": str(home), "CODEX_HOME": str(codex_home)})
    assert (work / "proof.txt").read_text().strip() == "cx-42-done"  # the exec_command call ran
    # codex exec prints the last answer alone on stdout (its progress goes to stderr)
    assert done.stdout.strip() == CODEX_ANSWER
    assert_round_trip(requests_since(served, seen), "/v1/responses")
