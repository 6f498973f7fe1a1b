"""The requests every server gets: the scenarios' sizes (``Plan``) and synthetic text sized with
the model's own tokenizer, deterministic per seed."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Plan:
    short_tokens: int
    concurrency: tuple[int, ...]
    long_prompt: int
    long_tokens: int
    longer_prompt: int
    cc_system: int
    cc_turns: int
    cc_tokens: int
    longest_prompt: int = 0  # a cold prompt of this many tokens, where the model's context holds it (0: none)
    claude_code: bool = True


FULL = Plan(short_tokens=256, concurrency=(1, 4, 8), long_prompt=2000, long_tokens=32, longer_prompt=6500,
            cc_system=16000, cc_turns=4, cc_tokens=64)
QUICK = Plan(short_tokens=32, concurrency=(1, 4, 8), long_prompt=500, long_tokens=16, longer_prompt=1500,
             cc_system=3000, cc_turns=2, cc_tokens=16)


@dataclass
class EditPlan:
    """The speculation comparison's two single-stream replies: a source file given back with one
    change (``edit``), and free prose (``prose``), where drafts rarely hit."""
    source: str  # a file of this repository (relative to its root) or any path, read at run time
    source_tokens: int  # the file is cut to whole lines within this many tokens
    edit_tokens: int  # the edit reply's length: most of the file
    prose_tokens: int


EDIT_FULL = EditPlan(source="worker/stream.py", source_tokens=1500, edit_tokens=1024, prose_tokens=512)
EDIT_QUICK = EditPlan(source="worker/stream.py", source_tokens=300, edit_tokens=64, prose_tokens=32)


@dataclass(frozen=True)
class EditSource:
    path: str  # as the prompt names it
    text: str
    tokens: int
    digest: str  # of the text, so that runs on different versions of the file can be told apart
    function: str  # the function the edit renames


def edit_source(plan: EditPlan, count: Callable[[str], int]) -> EditSource:
    """The plan's file, cut after the last whole line within ``plan.source_tokens``, and the
    first function it defines (the one the edit renames)."""
    path = Path(plan.source) if Path(plan.source).is_absolute() else REPO / plan.source
    text = ""
    for line in path.read_text().splitlines(keepends=True):
        if count(text + line) > plan.source_tokens:
            break
        text += line
    match = re.search(r"^\s*(?:async\s+)?def\s+(\w+)", text, re.MULTILINE)
    name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    return EditSource(name, text, count(text), hashlib.sha256(text.encode()).hexdigest()[:12],
                      match.group(1) if match else "main")


def edit_messages(source: EditSource) -> list[dict[str, Any]]:
    """The request an agent's whole-file write makes: the file, one change, the whole file back."""
    return [{"role": "user", "content": (
        f"Here is the file {source.path}:\n\n```python\n{source.text}```\n\n"
        f"Rename the function `{source.function}` to `{source.function}_v2`, and its uses. Reply with the "
        "whole file after the change, in one code block, and nothing else.")}]


def copied_share(source: str, reply: str) -> float | None:
    """The share of the reply's non-blank lines that are lines of the source (stripped): how much
    of the reply is the file copied, rather than text of the model's own."""
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    if not lines:
        return None
    known = {line.strip() for line in source.splitlines()}
    return sum(line in known for line in lines) / len(lines)


_SUBJECTS = ("the scheduler", "every gateway", "the cache layer", "a background job", "the parser",
             "our billing service", "the storage node", "each worker", "the retry loop", "the config loader",
             "the test runner", "a client library", "the index builder", "the metrics exporter")
_VERBS = ("reads", "rewrites", "validates", "forwards", "compresses", "batches", "logs", "retries",
          "serializes", "checks", "merges", "splits", "records", "rejects")
_OBJECTS = ("incoming requests", "the pending queue", "stale entries", "user settings", "partial uploads",
            "the audit trail", "large payloads", "expired tokens", "the nightly report", "shard boundaries",
            "duplicate events", "the schema version", "open connections", "rate limits")
_TAILS = ("before it answers", "once per minute", "when the disk is full", "under heavy load",
          "after a restart", "only in production", "for every tenant", "without holding a lock",
          "in a single pass", "when a deadline passes", "as soon as possible", "in the order they arrived")
_TOPICS = ("a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a lost violin",
           "a detective who is a cat", "a glacier that remembers", "a clockmaker's apprentice",
           "a library that never closes", "two rival bakers", "a map with one missing island")


def prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append(s[0].upper() + s[1:] + ".")
    return " ".join(out)


def sized_text(count: Callable[[str], int], target: int, seed: int, head: str = "") -> str:
    """``head`` followed by prose, as close to ``target`` tokens as whole sentences allow."""
    rng = random.Random(seed)
    text = head
    while count(text) < target:
        text = (text + " " if text else "") + prose(rng, max(1, (target - count(text)) // 14))
    while count(text) > target and ". " in text:
        text = text[:text.rstrip(".").rfind(". ") + 1]
    return text


def short_prompts(n: int) -> list[str]:
    return [f"Write a long story about {_TOPICS[i % len(_TOPICS)]}." for i in range(n)]


def tool_schemas(rng: random.Random, count: Callable[[str], int], target: int) -> list[dict[str, Any]]:
    """Tool definitions in Anthropic's shape, about ``target`` tokens as JSON."""
    names = ("read_file", "write_file", "edit_file", "list_directory", "search_text", "run_command",
             "fetch_url", "todo_update", "spawn_agent", "notebook_edit", "glob_files", "ask_user",
             "git_status", "open_browser", "run_tests", "format_code", "lint_code", "deploy_preview")
    tools: list[dict[str, Any]] = []
    i = 0
    while count(json.dumps(tools)) < target:
        name = names[i % len(names)] + ("" if i < len(names) else f"_{i // len(names)}")
        props = {f"arg_{k}": {"type": rng.choice(("string", "integer", "boolean")),
                              "description": prose(rng, 2)} for k in range(rng.randint(2, 5))}
        tools.append({"name": name, "description": prose(rng, 12),
                      "input_schema": {"type": "object", "properties": props, "required": list(props)[:1],
                                       "additionalProperties": False}})
        i += 1
    return tools


def claude_code_system(count: Callable[[str], int], target: int, seed: int,
                       session: str = "") -> tuple[str, list[dict[str, Any]]]:
    """A long system prompt: instructions plus the tool schemas written out; and a few tools."""
    rng = random.Random(seed)
    schemas = tool_schemas(rng, count, target * 3 // 5)
    reference = "\n".join(f"## {t['name']}\n{json.dumps(t, indent=1)}" for t in schemas)
    rest = max(0, target - count(reference) - 40)
    rules = sized_text(count, rest, seed + 1, f"Session {session}. You are a coding agent working in the "
                                              "user's repository.")
    system = f"{rules}\n\n# Tools\nThe tools below are available; call them by name.\n{reference}"
    return system, schemas[:4]


class Workload:
    """Requests shared by every server, sized with the model's own tokenizer."""

    def __init__(self, model_path: str, plan: Plan, nonce: int = 0):
        from shared.chat_template import chat_template_from_metadata
        from shared.tokenizer import Tokenizer
        from worker.engine.gguf_file import GGUFFile
        meta = GGUFFile(model_path).metadata
        self.context = int(meta.get(f"{meta.get('general.architecture')}.context_length", 0) or 0)
        self.tokenizer = Tokenizer.from_gguf_metadata(meta)
        self.template = chat_template_from_metadata(meta)
        self.plan = plan
        # base models (no chat template) are driven through the text completions endpoint
        self.path = "/v1/chat/completions" if self.template is not None else "/v1/completions"
        self.nonce = nonce  # starts every long prompt, so nothing of it is cached from an earlier run
        self.no_stop = {str(i): -100 for i in sorted(self.tokenizer.stop_ids | self.tokenizer.special_ids)}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special=False, parse_special=False))

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> int | None:
        """The prompt's length as the model's own template (or the plain text a base model
        gets) and tokenizer make it."""
        if self.template is None:
            return len(self.tokenizer.encode(self.plain(messages), add_special=True))
        return len(self.tokenizer.encode(self.template.render(messages), add_special=True))

    @staticmethod
    def plain(messages: list[dict[str, Any]]) -> str:
        """A conversation as the plain text a base model continues."""
        return "\n\n".join(str(m["content"]) for m in messages) + "\n\n"

    def chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int, exact: bool = True) -> dict[str, Any]:
        """A streaming request of the conversation: a chat completion, or a text completion of
        its plain text for a base model (``path`` says which)."""
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.template is None:
            body["prompt"] = self.plain(messages)
        else:
            body["messages"] = messages
        if exact:
            body["logit_bias"] = self.no_stop
        return body

    def long_conversation(self, seed: int, tokens: int | None = None) -> list[dict[str, Any]]:
        head = f"Session {self.nonce}-{seed}: summarise the operations notes below in three bullet points."
        size = (tokens or self.plan.long_prompt) - 20
        return [{"role": "user", "content": sized_text(self.count, size, seed, head)}]

    def claude_code(self, seed: int) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        system, tools = claude_code_system(self.count, self.plan.cc_system, seed, f"{self.nonce}-{seed}")
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Find where the retry loop handles expired tokens and explain it."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "I will look at the file first."},
                {"type": "tool_use", "id": "toolu_bench_1", "name": tools[0]["name"],
                 "input": {"arg_0": "src/retry.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_bench_1",
                 "content": sized_text(self.count, 400, seed + 7, "src/retry.py:")}]},
        ]
        return system, tools, messages
