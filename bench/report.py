"""The results: each figure's min / median / max over the repeats per server and their ratio, the
table (terminal and Markdown), the JSON file, the summary across models, and the printed report."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chart import write_chart
from bench.measure import RepeatFigures
from bench.peer import PEER_PACKAGE, PEER_REFERENCES, peer_kernel_line, peer_sanity_line
from bench.servers import LMSERVE, PEER, PEER_OFF, PEER_ON, SERVERS, SPEC_OFF, SPEC_ON
from bench.workload import EditPlan, Plan

LOWER, HIGHER = "lower", "higher"


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"min": self.min, "median": self.median, "max": self.max, "n": self.n}


def spread(values: Iterable[float | None]) -> Spread | None:
    """min / median / max of the values that are present; None if there are none."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return Spread(min(present), statistics.median(present), max(present), len(present))


def ratio(ours: Spread | None, theirs: Spread | None) -> float | None:
    """lmserve's median over the peer's, when both exist and the peer's is not zero."""
    if ours is None or theirs is None or theirs.median == 0:
        return None
    return ours.median / theirs.median


@dataclass
class Row:
    """One figure of the table: its per-repeat values for every server."""
    scenario: str
    metric: str
    unit: str
    better: str  # LOWER or HIGHER
    values: dict[str, list[float]] = field(default_factory=dict)
    note: dict[str, str] = field(default_factory=dict)  # per server: why a figure is missing

    @property
    def label(self) -> str:
        return f"{self.scenario}: {self.metric} ({self.unit})"

    def spread(self, server: str) -> Spread | None:
        return spread(self.values.get(server, []))

    def ratio(self) -> float | None:
        return ratio(self.spread(LMSERVE), self.spread(PEER))


def _number(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_cell(s: Spread | None, note: str = "") -> str:
    """``median (min-max)``, or the note (or ``n/a``) when the figure is missing."""
    if s is None:
        return note or "n/a"
    if s.n == 1 or s.min == s.max:
        return _number(s.median)
    return f"{_number(s.median)} ({_number(s.min)}-{_number(s.max)})"


def format_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def table_rows(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> list[list[str]]:
    """Header and body cells; the ratio column only when both servers are in the table."""
    both = LMSERVE in servers and PEER in servers
    header = ["figure", *(f"{s} median (min-max)" for s in servers), *([f"ratio {LMSERVE}/{PEER}"] if both else []),
              "better"]
    body = [[row.label, *(format_cell(row.spread(s), row.note.get(s, "")) for s in servers),
             *([format_ratio(row.ratio())] if both else []), row.better] for row in rows]
    return [header, *body]


def format_text_table(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> str:
    """A fixed-width table for the terminal."""
    cells = table_rows(rows, servers)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown_table(rows: Sequence[Row], servers: Sequence[str] = SERVERS) -> str:
    """The same table in Markdown (for the README)."""
    cells = table_rows(rows, servers)
    rule = "|" + "|".join(["---"] + ["---:"] * (len(cells[0]) - 2) + ["---"]) + "|"
    lines = ["| " + " | ".join(cells[0]) + " |", rule]
    lines += ["| " + " | ".join(line) + " |" for line in cells[1:]]
    return "\n".join(lines)


def results_json(rows: Sequence[Row], meta: dict[str, Any], servers: Sequence[str] = SERVERS) -> dict[str, Any]:
    """The JSON document written to bench/results/serve.json."""
    out_rows = []
    for row in rows:
        per_server: dict[str, Any] = {}
        for s in servers:
            sp = row.spread(s)
            per_server[s] = {"values": list(row.values.get(s, [])), **(sp.as_dict() if sp else {}),
                             **({"note": row.note[s]} if s in row.note else {})}
        out_rows.append({"scenario": row.scenario, "metric": row.metric, "unit": row.unit, "better": row.better,
                         "servers": per_server, "ratio": row.ratio()})
    return {"format": 1, "meta": meta, "servers": list(servers), "rows": out_rows,
            "markdown": format_markdown_table(rows, servers)}


ROW_SPECS: tuple[tuple[str, str, str, str], ...] = (
    ("ttft", "time to first token", "ms", LOWER),
    ("itl", "inter-token latency, median", "ms", LOWER),
    ("itl_p95", "inter-token latency, p95", "ms", LOWER),
    ("decode", "decode per stream", "tok/s", HIGHER),
    ("aggregate", "aggregate", "tok/s", HIGHER),
)
OTHER_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("long cold|ttft", "time to first token", "ms", LOWER),
    ("long cold|prefill", "prefill", "tok/s", HIGHER),
    ("long cold|decode", "decode at that context", "tok/s", HIGHER),
    ("longer cold|ttft", "time to first token", "ms", LOWER),
    ("longer cold|prefill", "prefill", "tok/s", HIGHER),
    ("longest cold|ttft", "time to first token", "ms", LOWER),
    ("longest cold|prefill", "prefill", "tok/s", HIGHER),
    ("next turn|ttft", "time to first token", "ms", LOWER),
    ("next turn|decode", "decode", "tok/s", HIGHER),
    ("claude-code|ttft first", "time to first token, turn 1 (cold)", "ms", LOWER),
    ("claude-code|ttft later", "time to first token, later turns", "ms", LOWER),
    ("claude-code|decode", "decode", "tok/s", HIGHER),
    ("memory|chat", "peak RSS, chat scenarios", "MiB", LOWER),
    ("memory|pss", "peak PSS, chat scenarios", "MiB", LOWER),
    ("memory|all", "peak RSS, with claude-code", "MiB", LOWER),
    ("start|cold", "start to ready, empty kernel cache", "s", LOWER),
    ("start|warm", "start to ready", "s", LOWER),
)


def scenario_titles(plan: Plan) -> dict[str, str]:
    return {"long cold": f"{plan.long_prompt}-token prompt, cold",
            "longer cold": f"{plan.longer_prompt}-token prompt, cold", "next turn": "next turn (prefix cached)",
            "longest cold": f"{plan.longest_prompt}-token prompt, cold",
            "claude-code": f"claude-code /v1/messages (~{plan.cc_system // 1000}k system)", "memory": "server",
            "start": "server"}


def build_rows(plan: Plan, per_server: dict[str, list[RepeatFigures]], notes: dict[str, dict[str, str]]) -> list[Row]:
    """Turn each server's per-repeat figures into table rows (pure)."""
    titles = scenario_titles(plan)
    keys: list[tuple[str, str, str, str, str]] = []
    for c in plan.concurrency:
        for metric, label, unit, better in ROW_SPECS:
            keys.append((f"short c={c}|{metric}", f"short+{plan.short_tokens}, {c} stream{'s' * (c > 1)}",
                         label, unit, better))
    for key, label, unit, better in OTHER_ROWS:
        keys.append((key, titles[key.split("|")[0]], label, unit, better))
    rows = []
    for key, scenario, label, unit, better in keys:
        row = Row(scenario, label, unit, better)
        for server, repeats in per_server.items():
            row.values[server] = [v for v in (r.values.get(key) for r in repeats) if v is not None]
            note = notes.get(server, {}).get(key.split("|")[0])
            if note and not row.values[server]:
                row.note[server] = note
        if any(row.values.values()):
            rows.append(row)
    return rows


def rows_from_json(document: dict[str, Any]) -> list[Row]:
    """The table rows back from a results document (the inverse of ``results_json``)."""
    rows = []
    for r in document["rows"]:
        row = Row(r["scenario"], r["metric"], r["unit"], r["better"])
        for server, cell in r["servers"].items():
            row.values[server] = list(cell.get("values", []))
            if "note" in cell:
                row.note[server] = cell["note"]
        rows.append(row)
    return rows


SUMMARY = (  # (row key, what it shows) for the summary across models
    ("long cold|prefill", "prefill, cold ~2k prompt"),
    ("longest cold|ttft", "TTFT, cold 16k prompt (lower is better)"),
    ("short c=1|decode", "decode, 1 stream"),
    ("short c=4|aggregate", "aggregate, 4 streams"),
    ("memory|pss", "memory of the stack, PSS (lower is better)"),
    ("memory|chat", "memory of the stack, RSS (lower is better)"),
    ("start|warm", "start to ready (lower is better)"),
)


def summary_table(documents: list[dict[str, Any]]) -> str:
    """One markdown row per model: lmserve's median, llama.cpp's, and their ratio, per figure."""
    head = "| file | " + " | ".join(label for _, label in SUMMARY) + " | lmserve first start |"
    lines = [head, "|" + "---|" * (len(SUMMARY) + 2)]
    for document in documents:
        cells = []
        for key, _ in SUMMARY:
            ours, theirs, unit = medians(document, key)
            if ours is None:
                cells.append("—")
            elif theirs:
                cells.append(f"{_number(ours)} / {_number(theirs)} {unit} = {ours / theirs:.2f}")
            else:
                cells.append(f"{_number(ours)} {unit}")
        first, _, _ = medians(document, "start|cold")
        cells.append(f"{first:.1f} s" if first is not None else "—")
        lines.append(f"| {document['meta'].get('model')} | " + " | ".join(cells) + " |")
    floor = next((d["meta"]["floor"] for d in documents if d["meta"].get("floor")), None)
    if floor:
        lines.append("")
        lines.append(f"{floor['model']}: {floor['line']}")
    return "\n".join(lines)


def medians(document: dict[str, Any], key: str) -> tuple[float | None, float | None, str]:
    """(lmserve's median, llama.cpp's median, unit) of a figure, by its row key."""
    plan = Plan(**{**document["meta"]["plan"], "concurrency": tuple(document["meta"]["plan"]["concurrency"])})
    scenario, metric = key.split("|")
    if scenario.startswith("short"):
        c = int(scenario.split("=")[1])
        title = f"short+{plan.short_tokens}, {c} stream{'s' * (c > 1)}"
        label = {m: text for m, text, _, _ in ROW_SPECS}[metric]
    else:
        title = scenario_titles(plan)[scenario]
        label = {k: text for k, text, _, _ in OTHER_ROWS}[key]
    for row in document["rows"]:
        if row["scenario"] == title and row["metric"] == label:
            found = [statistics.median(row["servers"][s]["values"]) if row["servers"].get(s, {}).get("values")
                     else None for s in SERVERS]
            return found[0], found[1], row["unit"]
    return None, None, ""


def load_summary(meta: dict[str, Any]) -> str | None:
    """Other processes' CPU use during the measured scenarios, from the results' checks."""
    readings = [v for runs in (meta.get("checks") or {}).values() for run in runs
                for v in (run.get("other cores per scenario") or {}).values() if v is not None]
    if not readings:
        return None
    busy = sum(v > 0.25 for v in readings)
    return (f"load from other processes during the scenarios: {statistics.median(readings):.2f} cores median, "
            f"{max(readings):.2f} max (of {(meta.get('machine') or {}).get('cores', '?')}); "
            f"{busy} of {len(readings)} scenario runs had more than 0.25 cores of it")


def print_report(document: dict[str, Any], out: Path) -> None:
    """Print the table and the sanity lines; draw the chart beside the JSON."""
    meta = document["meta"]
    rows = rows_from_json(document)
    done = meta.get("repeats_done") or {}
    print()
    print(f"serving benchmark, {meta.get('model')}, {meta.get('threads')} threads, ctx {meta.get('ctx')}, "
          f"repeats {done or meta.get('repeats')}; median (min-max) over repeats")
    print(format_text_table(rows, document["servers"]))
    summary = load_summary(meta)
    if summary:
        print(summary)
    if meta.get("peer_kernels"):
        print(peer_kernel_line(meta["peer_kernels"]))
    peer_single = meta.get("peer_single_stream_decode")
    if peer_single is not None:
        print(peer_sanity_line(peer_single["median"], meta.get("peer_kernels")))
    png = out.with_suffix(".png")
    title = f"lmserve vs llama.cpp ({PEER_PACKAGE}), {meta.get('model')}, {meta.get('threads')} threads"
    if write_chart(rows, png, title):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out}")


def write_results(out: Path, plan: Plan, per_server: dict[str, list[RepeatFigures]],
                  notes: dict[str, dict[str, str]], meta: dict[str, Any]) -> dict[str, Any]:
    """Write the JSON (after every server run, so an interrupted run keeps what it measured)."""
    rows = build_rows(plan, per_server, notes)
    meta = {**meta, "plan": dataclasses.asdict(plan), "repeats_done": {s: len(r) for s, r in per_server.items()},
            "checks": {s: [r.checks for r in reps] for s, reps in per_server.items()}}
    single = next((r for r in rows if r.scenario.endswith(", 1 stream") and r.metric == "decode per stream"), None)
    peer_single = single.spread(PEER) if single else None
    if peer_single is not None:
        meta["peer_single_stream_decode"] = {"median": peer_single.median,
                                             "references": {k: list(v) for k, v in PEER_REFERENCES.items()}}
    servers = [s for s in SERVERS if s in per_server]
    return write_document(out, results_json(rows, meta, servers))


def write_document(out: Path, document: dict[str, Any]) -> dict[str, Any]:
    """Replace the file at once: a reader never sees half of it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(partial, out)
    return document


SPECULATION_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("edit|decode", "decode", "tok/s", HIGHER),
    ("edit|acceptance", "drafts that stood", "share", HIGHER),
    ("prose|decode", "decode", "tok/s", HIGHER),
    ("prose|acceptance", "drafts that stood", "share", HIGHER),
)
# (name, numerator, denominator, workload, target): the ratios of medians issue 33 asks for
SPECULATION_TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    ("edit: lmserve+spec / llama.cpp without speculation", SPEC_ON, PEER_OFF, "edit", 2.0),
    ("edit: lmserve+spec / llama.cpp n-gram speculation", SPEC_ON, PEER_ON, "edit", 1.3),
    ("prose: lmserve+spec / lmserve without speculation", SPEC_ON, SPEC_OFF, "prose", 0.95),
)


def speculation_titles(plan: EditPlan, source_tokens: int | None = None) -> dict[str, str]:
    size = source_tokens or plan.source_tokens
    return {"edit": f"edit: ~{size}-token file back, {plan.edit_tokens} tokens",
            "prose": f"free prose, {plan.prose_tokens} tokens"}


def build_speculation_rows(plan: EditPlan, per_variant: dict[str, list[RepeatFigures]],
                           source_tokens: int | None = None) -> list[Row]:
    """Each variant's per-repeat decode rates and acceptance as table rows (pure)."""
    titles = speculation_titles(plan, source_tokens)
    rows = []
    for key, label, unit, better in SPECULATION_ROWS:
        row = Row(titles[key.split("|")[0]], label, unit, better)
        for variant, repeats in per_variant.items():
            row.values[variant] = [v for v in (r.values.get(key) for r in repeats) if v is not None]
        if any(row.values.values()):
            rows.append(row)
    return rows


def speculation_ratios(rows: Sequence[Row]) -> list[tuple[str, float | None, float]]:
    """(name, ratio of the medians or None where a figure is missing, target) of each
    SPECULATION_TARGETS ratio, from the decode rows."""
    decode = {("edit" if row.scenario.startswith("edit") else "prose"): row for row in rows if row.metric == "decode"}
    out = []
    for name, ours, theirs, workload, target in SPECULATION_TARGETS:
        row = decode.get(workload)
        out.append((name, ratio(row.spread(ours), row.spread(theirs)) if row else None, target))
    return out


def format_speculation_ratios(ratios: Sequence[tuple[str, float | None, float]]) -> str:
    lines = []
    width = max(len(name) for name, _, _ in ratios)
    for name, value, target in ratios:
        verdict = "n/a" if value is None else ("meets" if value >= target else "MISSES")
        shown = "" if value is None else f"{value:.2f}x"
        lines.append(f"{name.ljust(width)}  {shown:>6}  target >= {target:.2f}: {verdict}")
    return "\n".join(lines)


def write_speculation_results(out: Path, plan: EditPlan, per_variant: dict[str, list[RepeatFigures]],
                              meta: dict[str, Any]) -> dict[str, Any]:
    """The speculation comparison's JSON (after every server run, as ``write_results``)."""
    source = meta.get("edit_source") or {}
    rows = build_speculation_rows(plan, per_variant, source.get("tokens"))
    meta = {**meta, "workload": "edit", "plan": dataclasses.asdict(plan),
            "repeats_done": {v: len(r) for v, r in per_variant.items()},
            "checks": {v: [r.checks for r in reps] for v, reps in per_variant.items()}}
    document = results_json(rows, meta, list(per_variant))
    document["ratios"] = [{"name": n, "ratio": r, "target": t} for n, r, t in speculation_ratios(rows)]
    return write_document(out, document)


def print_speculation_report(document: dict[str, Any]) -> None:
    """The side-by-side table of the four variants, the ratios against their targets, and each
    variant's edit reply: how much of it is the file copied, and what its drafts did."""
    meta = document["meta"]
    rows = rows_from_json(document)
    source = meta.get("edit_source") or {}
    print()
    print(f"speculative decoding, {meta.get('model')}, {meta.get('threads')} threads, one stream, greedy; "
          f"edit source {source.get('path')} ({source.get('tokens')} tokens, sha256 {source.get('digest')}); "
          f"repeats {meta.get('repeats_done') or meta.get('repeats')}; median (min-max) over repeats")
    print(format_text_table(rows, document["servers"]))
    print()
    print(format_speculation_ratios(speculation_ratios(rows)))
    for variant, runs in (meta.get("checks") or {}).items():
        copied = [run.get("edit lines copied from the file") for run in runs]
        drafts = [run.get("edit speculation") for run in runs]
        print(f"{variant}: edit reply lines copied from the file {copied}; drafts {drafts}")
    for variant, command in (meta.get("server_commands") or {}).items():
        print(f"{variant}: {' '.join(command)}")
