"""Every scenario once against one running server: time to first token, inter-token latency,
decode per stream, aggregate, prefill, the next turn's cached prefix, a Claude-Code session, and
the peak memory the sampler saw meanwhile."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.memory import MemorySampler
from bench.streams import run_batch, served_model, serves_messages
from bench.workload import (
    EditPlan,
    EditSource,
    Workload,
    copied_share,
    edit_messages,
    prose,
    short_prompts,
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; values must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class RepeatFigures:
    values: dict[str, float | None] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


async def run_server_repeat(base_url: str, work: Workload, repeat: int, sampler: MemorySampler | None,
                            quiet: float = -1.0, quiet_wait: float = 0.0) -> RepeatFigures:
    """Every scenario once against one server. With a sampler and ``quiet`` >= 0, each scenario
    first waits (up to quiet_wait s) until other processes use at most ``quiet`` cores."""
    import httpx
    plan = work.plan
    figs = RepeatFigures()
    chat_path = work.path
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        model = await served_model(client, base_url)
        # warm-up: first-request costs (imports, allocations) are not part of any figure
        await run_batch(client, base_url, chat_path, [work.chat(model, [{"role": "user", "content": "Hello"}], 4)])
        prompts = short_prompts(max(plan.concurrency))
        others: dict[str, float | None] = {}
        figs.checks["other cores per scenario"] = others
        mark = sampler.mark() if sampler else None

        async def settle() -> None:
            nonlocal mark
            if sampler is None or sampler.pid is None or quiet < 0:
                return
            waited = 0.0
            while True:
                probe = sampler.mark()
                await asyncio.sleep(3.0)
                busy = sampler.other_cores(probe) or 0.0
                if busy <= quiet or waited >= quiet_wait:
                    break
                waited += 3.0
            mark = sampler.mark()

        def enter(scenario: str) -> None:
            if sampler is not None:
                sampler.phase = scenario

        def note_load(scenario: str) -> None:
            if sampler is not None and mark is not None:
                value = sampler.other_cores(mark)
                others[scenario] = None if value is None else round(value, 2)

        for c in plan.concurrency:
            await settle()
            enter(f"short c={c}")
            bodies = [work.chat(model, [{"role": "user", "content": p}], plan.short_tokens) for p in prompts[:c]]
            results, wall = await run_batch(client, base_url, chat_path, bodies)
            n = plan.short_tokens
            tokens = [r.output_tokens(n) for r in results]
            gaps = [g for r in results for g in r.gaps()]
            key = f"short c={c}"
            figs.values[f"{key}|ttft"] = _ms(_median(r.ttft for r in results))
            figs.values[f"{key}|itl"] = _ms(statistics.median(gaps)) if gaps else None
            figs.values[f"{key}|itl_p95"] = _ms(percentile(gaps, 95)) if gaps else None
            figs.values[f"{key}|decode"] = _median(r.decode_rate(n) for r in results)
            figs.values[f"{key}|aggregate"] = sum(tokens) / wall
            figs.checks[f"{key} exact length"] = all(t == n and r.finish_reason == "length"
                                                     for t, r in zip(tokens, results))
            figs.checks[f"{key} tokens"] = tokens
            figs.checks[f"{key} usage reported"] = all(r.tokens is not None for r in results)
            note_load(key)
        # long prompt, cold, then the same conversation's next turn
        conversation = work.long_conversation(10_000 * (repeat + 1) + 17)
        await settle()
        enter("long cold")
        (cold,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, conversation, plan.long_tokens)])
        prompt_tokens = work.prompt_tokens(conversation)
        figs.values["long cold|ttft"] = _ms(cold.ttft)
        figs.values["long cold|prefill"] = prompt_tokens / cold.ttft if prompt_tokens and cold.ttft else None
        figs.values["long cold|decode"] = cold.decode_rate(plan.long_tokens)
        figs.checks["long cold prompt tokens"] = {"counted": prompt_tokens, "reported": cold.prompt_tokens}
        note_load("long cold")
        conversation += [{"role": "assistant", "content": cold.text},
                         {"role": "user", "content": "Now list the two riskiest items and say why."}]
        await settle()
        enter("next turn")
        (nxt,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, conversation, plan.long_tokens)])
        figs.values["next turn|ttft"] = _ms(nxt.ttft)
        figs.values["next turn|decode"] = nxt.decode_rate(plan.long_tokens)
        figs.checks["next turn prompt tokens"] = {"counted": work.prompt_tokens(conversation),
                                                  "reported": nxt.prompt_tokens}
        figs.checks["next turn cached tokens"] = nxt.cached_tokens
        note_load("next turn")
        if plan.longer_prompt:
            longer = work.long_conversation(10_000 * (repeat + 1) + 29, plan.longer_prompt)
            await settle()
            enter("longer cold")
            (far,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, longer, 4)])
            longer_tokens = work.prompt_tokens(longer)
            figs.values["longer cold|ttft"] = _ms(far.ttft)
            figs.values["longer cold|prefill"] = longer_tokens / far.ttft if longer_tokens and far.ttft else None
            figs.checks["longer cold prompt tokens"] = {"counted": longer_tokens, "reported": far.prompt_tokens}
            note_load("longer cold")
        if plan.longest_prompt and work.context >= plan.longest_prompt + 64:
            longest = work.long_conversation(10_000 * (repeat + 1) + 31, plan.longest_prompt)
            await settle()
            enter("longest cold")
            (cold16,), _ = await run_batch(client, base_url, chat_path, [work.chat(model, longest, 4)])
            longest_tokens = work.prompt_tokens(longest)
            figs.values["longest cold|ttft"] = _ms(cold16.ttft)
            figs.values["longest cold|prefill"] = (longest_tokens / cold16.ttft if longest_tokens and cold16.ttft
                                                   else None)
            figs.checks["longest cold prompt tokens"] = {"counted": longest_tokens, "reported": cold16.prompt_tokens}
            note_load("longest cold")
        if sampler is not None:
            figs.values["memory|chat"] = sampler.peak / 2**20
            figs.values["memory|pss"] = sampler.peak_pss / 2**20
            figs.checks["peak PSS by process (MiB)"] = {k: round(v / 2**20, 1) for k, v in sampler.roles.items()}
            figs.checks["peak PSS by scenario (MiB)"] = {k: round(v / 2**20, 1) for k, v in sampler.phases.items()}
        # a Claude-Code-shaped session through /v1/messages
        if not plan.claude_code:
            figs.checks["claude-code"] = "skipped (--no-claude-code)"
        elif await serves_messages(client, base_url, model):
            system, tools, messages = work.claude_code(repeat)
            await settle()
            ttfts, rates, cached = [], [], []
            try:
                for turn in range(plan.cc_turns):
                    body = {"model": model, "max_tokens": plan.cc_tokens, "stream": True, "temperature": 0,
                            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                            "tools": tools, "messages": messages}
                    (r,), _ = await run_batch(client, base_url, "/v1/messages", [body])
                    ttfts.append(r.ttft)
                    rates.append(r.decode_rate())
                    cached.append(r.cached_tokens)
                    if turn == 0:
                        figs.checks["claude-code prompt tokens"] = r.prompt_tokens
                    messages = messages + [{"role": "assistant", "content": r.text or "(no text)"},
                                           {"role": "user", "content": prose(random.Random(turn), 4)}]
            except httpx.HTTPError as exc:  # a server that dies mid-session fails this scenario only
                figs.checks["claude-code"] = f"failed at turn {len(ttfts) + 1}: {type(exc).__name__}: {exc}"
                return figs
            figs.values["claude-code|ttft first"] = _ms(ttfts[0])
            figs.values["claude-code|ttft later"] = _ms(_median(ttfts[1:]))
            figs.values["claude-code|decode"] = _median(rates)
            figs.checks["claude-code cached tokens per turn"] = cached
            figs.checks["claude-code ttft per turn (ms)"] = [_ms(t) for t in ttfts]
            note_load("claude-code")
            if sampler is not None:
                figs.values["memory|all"] = sampler.peak / 2**20
        else:
            figs.checks["claude-code"] = "skipped: no /v1/messages"
    return figs


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


async def run_speculation_repeat(base_url: str, work: Workload, plan: EditPlan, source: EditSource,
                                 repeat: int) -> RepeatFigures:
    """The edit reply and the free-prose reply once, one stream at a time: decode tokens/s,
    what speculation drafted and what stood, and how much of the edit reply is the file copied."""
    import httpx
    figs = RepeatFigures()
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        model = await served_model(client, base_url)
        # warm-up, with text to draft from: the first pass of every width is not part of a figure
        echo = "one two three four five six seven eight " * 4
        for content in ("Hello", f"Repeat this: {echo}"):
            await run_batch(client, base_url, work.path, [work.chat(model, [{"role": "user", "content": content}], 24)])
        replies = (("edit", edit_messages(source), plan.edit_tokens),
                   ("prose", [{"role": "user", "content": short_prompts(repeat + 1)[repeat]}], plan.prose_tokens))
        for key, messages, n in replies:
            (r,), _ = await run_batch(client, base_url, work.path, [work.chat(model, messages, n)])
            figs.values[f"{key}|decode"] = r.decode_rate(n)
            figs.values[f"{key}|acceptance"] = r.acceptance
            figs.checks[f"{key} exact length"] = r.output_tokens(n) == n and r.finish_reason == "length"
            figs.checks[f"{key} speculation"] = ({"drafted": r.drafted, "accepted": r.accepted}
                                                 if r.drafted is not None else "not reported")
            if key == "edit":
                figs.checks["edit prompt tokens"] = r.prompt_tokens
                share = copied_share(source.text, r.text)
                figs.checks["edit lines copied from the file"] = None if share is None else round(share, 2)
                figs.checks["edit reply head"] = r.text[:160]
    return figs
