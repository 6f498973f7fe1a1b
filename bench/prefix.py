"""Prefix reuse on a Claude-Code-shaped conversation: time to first token cold, with the
conversation's KV resident in a slot, and after a worker restart restoring it from the kvstore.

    python -m bench.prefix [MODEL.gguf] [--system-tokens 16000] [--turns 3]

A real worker (with a --kv-cache-dir kvstore) and a real gateway are started; the client is the
official anthropic SDK streaming /v1/messages with a long system prompt and tool schemas, as
Claude Code sends them. Each turn appends the previous answer and a new question.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anthropic
import httpx

REPO = Path(__file__).resolve().parent.parent

TOOL_NAMES = ["Bash", "Read", "Edit", "Write", "Glob", "Grep", "Task", "TodoWrite", "WebFetch", "NotebookEdit"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claude_code_shaped(system_tokens: int) -> tuple[list[dict], list[dict]]:
    """A system prompt of roughly ``system_tokens`` tokens and a set of tool schemas."""
    rule = ("When you edit a file, read it first, keep the surrounding style, and run the tests that "
            "cover the change before you report it done. Prefer small, reviewable steps. ")
    sections = []
    words = 0
    n = 0
    while words < system_tokens * 0.7:  # English runs ~1.3 tokens a word here
        n += 1
        sections.append(f"## Guideline {n}\n{rule * 3}")
        words += len(rule.split()) * 3 + 3
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=00000;"},
              {"type": "text", "text": "You are a coding assistant.\n\n" + "\n\n".join(sections)}]
    tools = [{"name": name, "description": f"The {name} tool. " + rule,
              "input_schema": {"type": "object", "properties": {
                  "path": {"type": "string", "description": "Absolute path."},
                  "pattern": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
                  "required": ["path"]}} for name in TOOL_NAMES]
    return system, tools


class Stack:
    def __init__(self, model: str | None, ctx: int, kv_dir: str):
        self.worker_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.port = _free_port()
        self.worker_args = [sys.executable, "-m", "launcher.cli", "worker", *([model] if model else []),
                            "--worker", self.worker_endpoint, "--ctx", str(ctx), "--kv-cache-dir", kv_dir,
                            "--kv-disk-slots", "4"]
        self.worker = self._spawn(self.worker_args)
        self.gateway = self._spawn([sys.executable, "-m", "launcher.cli", "gateway", "--worker", self.worker_endpoint,
                                    "--port", str(self.port)])
        self.wait()

    @staticmethod
    def _spawn(args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("the stack did not get ready")

    def restart_worker(self) -> None:
        self.worker.terminate()  # a clean stop: resident slots are spilled on the way out
        self.worker.wait(120)
        self.worker = self._spawn(self.worker_args)
        time.sleep(2)  # the gateway notices the new worker within a heartbeat or two
        self.wait()

    def close(self) -> None:
        for proc in (self.gateway, self.worker):
            proc.terminate()
            proc.wait(60)


def ask(client: anthropic.Anthropic, system, tools, messages) -> tuple[float, str, dict]:
    started = time.perf_counter()
    first = None
    with client.messages.stream(model="claude-sonnet-4-6", max_tokens=24, system=system, tools=tools,
                                messages=messages) as stream:
        for _ in stream.text_stream:
            if first is None:
                first = time.perf_counter() - started
        final = stream.get_final_message()
    text = "".join(block.text for block in final.content if block.type == "text")
    usage = final.usage
    return (first if first is not None else time.perf_counter() - started), text, {
        "prompt": usage.input_tokens + (usage.cache_read_input_tokens or 0),
        "cached": usage.cache_read_input_tokens or 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--system-tokens", type=int, default=16000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    system, tools = claude_code_shaped(args.system_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmserve-kv-") as kv_dir:
        stack = Stack(args.model, args.system_tokens + 4096, kv_dir)
        try:
            client = anthropic.Anthropic(base_url=stack.url, api_key="bench", max_retries=0, timeout=1800)
            messages = [{"role": "user", "content": "Which file holds the entry point?"}]
            for turn in range(1, args.turns + 1):
                label = "cold" if turn == 1 else "resident slot"
                if turn == args.turns and args.turns > 2:
                    stack.restart_worker()
                    label = "after worker restart (restored)"
                ttft, text, usage = ask(client, system, tools, messages)
                rows.append({"turn": turn, "scenario": label, "ttft_s": ttft, **usage})
                messages += [{"role": "assistant", "content": text or "ok"},
                             {"role": "user", "content": f"And what does step {turn} do?"}]
        finally:
            stack.close()
    print(f"Claude-Code-shaped conversation, ~{args.system_tokens}-token system prompt with "
          f"{len(TOOL_NAMES)} tools, through /v1/messages")
    print(f"{'turn':>4s}  {'scenario':34s} {'prompt':>7s} {'cached':>7s} {'TTFT (s)':>9s} {'vs cold':>8s}")
    cold = rows[0]["ttft_s"]
    for row in rows:
        print(f"{row['turn']:4d}  {row['scenario']:34s} {row['prompt']:7d} {row['cached']:7d} "
              f"{row['ttft_s']:9.2f} {cold / row['ttft_s']:7.1f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
