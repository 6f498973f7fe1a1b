"""lmserve and llama.cpp's server side by side: the same GGUF, the same requests, one run.

    python -m bench.serve [--repeats 3] [--quick] [--model MODEL.gguf]
    python -m bench.serve --url lmserve=http://127.0.0.1:8080     (drive a running server)

Both servers are started by the harness, one at a time (never together: they would share the
cores), and restarted for every repeat so that each repeat starts cold and the repeats of the two
servers interleave (a burst of load from elsewhere then hits both, not one):

* lmserve: ``lmserve serve MODEL --ctx N --batch 8 --kv-slots 8 --threads T`` from this venv;
* llama.cpp: its C++ ``llama-server``, built with cmake from the llama.cpp tree vendored in the
  ``llama-cpp-python`` sdist (--peer-build; the first of /work/peer-build and .bench-peer/ that
  holds a build, else .bench-peer/ is built, which takes 15-30 minutes on 2 cores), with
  ``-t/-tb`` set to --threads, ``--parallel`` slots as lmserve's --batch, one KV buffer shared by
  the slots (``--kv-unified``) of the same context, and its defaults otherwise (flash attention
  auto, prompt cache on).

Every request streams. Time to first token (TTFT) is measured to the first chunk that carries
content (a bare role chunk does not count); inter-token latency (ITL) is the gap between
content chunks; decode tokens/s per stream is (tokens - 1) / (last chunk - first chunk);
aggregate tokens/s is all streams' tokens over the wall time of the whole batch. Streams that
must have an exact length have every end-of-turn and control token biased away (logit_bias
-100), and the harness checks that each one produced exactly max_tokens.

Scenarios:

1. ``short``: a short prompt + 256 generated tokens, at concurrency 1, 4 and 8;
2. ``long cold``: a fresh 2,000-token prompt (nothing of it cached) + 32 tokens, and
   ``longer cold``: a fresh 6,500-token one (time to first token only);
3. ``next turn``: that conversation's next turn, whose prefix the server may have cached;
4. ``claude-code``: a Claude-Code-shaped session through ``/v1/messages`` (a ~16k-token system
   prompt with tool schemas, a tool round trip, then several turns), on servers that serve
   ``/v1/messages``.

``--speculation`` runs instead the speculative-decoding comparison, one stream, greedy, every
token of the reply forced (end-of-turn biased away): an ``edit`` reply (a ~1.5k-token file of this
repository, read at run time, asked back whole with one function renamed, as an agent's
whole-file write makes a model do) and a ``free prose`` one, where drafts rarely hit, on four
servers: lmserve with ``--spec off`` and with ``--spec ngram --spec-max N``, llama-server
without speculation and with its n-gram speculation (``--peer-spec``). Its table gives decode
tokens/s and the share of drafted tokens that stood, and the ratios issue 33 sets targets for.
Results go to ``bench/results/speculation.json``.

Peak memory is the largest sum of RSS over the server's process tree, sampled every 100 ms.
Every figure is min / median / max over the repeats (each repeat's value is the median over its
streams); the ratio is lmserve's median over llama.cpp's. Results go to
``bench/results/serve.json`` and ``bench/results/serve.png`` (the chart needs matplotlib:
``pip install -e '.[bench]'``). The JSON is rewritten after every server run, so an interrupted
run keeps what it measured; ``--render JSON`` reprints a results file's table and redraws its chart.

On a shared machine other processes skew everything, the two servers differently. Before each
server run and each scenario the harness waits (``--quiet``, ``--quiet-wait``) until the rest of
the machine is nearly idle, and it records the cores other processes used during every scenario
(``other cores per scenario`` in the JSON's checks).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import lmserve_gemm, machine_facts, wait_for_quiet
from bench.measure import RepeatFigures, run_server_repeat, run_speculation_repeat
from bench.memory import MemorySampler
from bench.peer import (
    PEER_CMAKE_ARGS,
    PEER_PACKAGE,
    PEER_VERSION,
    ensure_peer,
    find_peer_build,
    peer_kernel_line,
    peer_kernels,
    peer_version,
)
from bench.report import (
    print_report,
    print_speculation_report,
    summary_table,
    write_results,
    write_speculation_results,
)
from bench.servers import (
    LMSERVE,
    PEER,
    PEER_NGRAM,
    SERVERS,
    lmserve_spec,
    peer_spec,
    settle,
    speculation_variants,
    start_server,
    stop_server,
)
from bench.workload import (
    EDIT_FULL,
    EDIT_QUICK,
    FULL,
    QUICK,
    EditPlan,
    Plan,
    Workload,
    edit_source,
)
from worker.speculation import SpeculationSettings

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def _git_revision() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the default model)")
    p.add_argument("--models", help="several, one after another, each with its own results and a summary across "
                                    "them: paths, names `lmserve models` knows, or SHAPE:TYPE for a file of a real "
                                    "model's shapes bench.synthetic writes (e.g. qwen3-0.6b:Q8_0)")
    p.add_argument("--concurrency", help="stream counts of the short scenario (default 1,4,8)")
    p.add_argument("--longest", type=int, default=0, metavar="TOKENS",
                   help="also a cold prompt of this many tokens, where the model's context holds it (0: none)")
    p.add_argument("--longer", type=int, default=None, metavar="TOKENS",
                   help="tokens of the second cold prompt (default 6500; 1500 quick; 0: none)")
    p.add_argument("--no-claude-code", action="store_true", help="skip the claude-code session")
    p.add_argument("--kv-slots", type=int, default=None, help="lmserve --kv-slots (default: lmserve's own)")
    p.add_argument("--floor", metavar="MODEL",
                   help="also both servers at their smallest setting (--ctx 4096 and one slot) on this model: "
                        "peak memory")
    p.add_argument("--repeats", type=int, default=None, help="runs of every server (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, fewer tokens, shorter prompts")
    p.add_argument("--ctx", type=int, default=20480, help="context of both servers (default 20480)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of both servers (default 2)")
    p.add_argument("--parallel", type=int, default=8, help="lmserve --batch and --kv-slots (default 8)")
    p.add_argument("--servers", default=",".join(SERVERS), help="which to start (default: both)")
    p.add_argument("--peer-build", help="cmake build directory of llama.cpp whose bin/ holds llama-server and "
                                        "llama-bench (default: /work/peer-build if it has them, else .bench-peer/, "
                                        "built if missing)")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="drive an already running server instead of starting it (no memory figures)")
    p.add_argument("--quiet", type=float, default=0.5, metavar="CORES",
                   help="before each server run, wait until other processes use at most this many cores "
                        "(default 0.5; a negative value never waits)")
    p.add_argument("--quiet-wait", type=float, default=300, metavar="S",
                   help="longest wait for that (and before each scenario), in seconds (default 300)")
    p.add_argument("--cc-system", type=int, help="claude-code system prompt tokens (default 16000; 3000 quick)")
    p.add_argument("--speculation", action="store_true",
                   help="only the speculative-decoding comparison: the edit and free-prose replies on lmserve "
                        "--spec off / ngram and llama-server without / with n-gram speculation")
    p.add_argument("--spec-max", type=int, default=SpeculationSettings.max_draft, metavar="N",
                   help=f"with --speculation: lmserve's --spec-max (default {SpeculationSettings.max_draft})")
    p.add_argument("--peer-spec", default=" ".join(PEER_NGRAM), metavar="FLAGS",
                   help=f"with --speculation: llama-server's n-gram speculation flags (default "
                        f"'{' '.join(PEER_NGRAM)}', the best of a trial on the edit reply)")
    p.add_argument("--edit-source", metavar="FILE",
                   help=f"with --speculation: the file the edit reply gives back (default {EDIT_FULL.source})")
    p.add_argument("--render", metavar="JSON", help="only print the table and redraw the chart of a results file")
    p.add_argument("--out", default=None,
                   help="JSON output (default bench/results/serve.json, or speculation.json with --speculation; "
                        "the PNG goes beside it)")
    return p.parse_args(argv)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def resolve_models(names: str) -> list[str]:
    """GGUF paths for --models: a path, a name ``lmserve models`` knows, or ``SHAPE:TYPE`` for a
    file of a real model's shapes that bench.synthetic writes (once, under bench/results/models)."""
    from shared.default_model import MODELS, model_path
    paths = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in MODELS:
            paths.append(str(model_path(name)))
        elif ":" in name and not os.path.exists(name):
            shape, qtype = name.split(":", 1)
            out = RESULTS / "models"
            target = out / f"{shape}-synthetic-{qtype}.gguf"
            if not target.exists():
                subprocess.run([sys.executable, "-m", "bench.synthetic", "write", shape, "--type", qtype,
                                "--out", str(out)], cwd=REPO, check=True)
            paths.append(str(target))
        else:
            paths.append(name)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        path = Path(args.render)
        document = json.loads(path.read_text())
        if document["meta"].get("workload") == "edit":
            print_speculation_report(document)
        else:
            print_report(document, path)
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.speculation:
        return run_speculation(args, argv)
    args.out = args.out or str(RESULTS / "serve.json")
    plan = QUICK if args.quick else FULL
    if args.cc_system:
        plan = dataclasses.replace(plan, cc_system=args.cc_system)
    if args.longer is not None:
        plan = dataclasses.replace(plan, longer_prompt=args.longer)
    plan = dataclasses.replace(plan, longest_prompt=args.longest, claude_code=not args.no_claude_code,
                               concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency
                               else plan.concurrency)
    repeats = args.repeats or (1 if args.quick else 3)
    from shared.default_model import default_model_path
    models = resolve_models(args.models) if args.models else [args.model or str(default_model_path())]
    external = dict(u.split("=", 1) for u in args.url)
    wanted = [s for s in args.servers.split(",") if s] if not external else list(external)
    unknown = [s for s in wanted if s not in SERVERS]
    if unknown:
        print(f"bench.serve: unknown server(s) {unknown}; names are {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    peer_bin = ensure_peer(find_peer_build(args.peer_build)) if PEER in wanted and PEER not in external else None
    documents = []
    for model in models:
        out = Path(args.out) if len(models) == 1 else Path(args.out).with_name(f"serve-{Path(model).stem}.json")
        documents.append(run_model(args, argv, model, plan, repeats, wanted, external, peer_bin, out))
    if args.floor:
        floor = memory_floor(args, resolve_models(args.floor)[0], wanted, peer_bin)
        print(floor["line"])
        for document in documents:
            document["meta"]["floor"] = floor
    if len(models) > 1 or args.floor:
        summary = summary_table(documents)
        print()
        print(summary)
        (Path(args.out).with_name("serve-summary.md")).write_text(summary + "\n")
        (Path(args.out).with_name("serve-summary.json")).write_text(json.dumps(
            {"models": [d["meta"] for d in documents], "rows": [d["rows"] for d in documents]}, indent=1) + "\n")
    return 0


def run_model(args: argparse.Namespace, argv: list[str] | None, model: str, plan: Plan, repeats: int,
              wanted: list[str], external: dict[str, str], peer_bin: Path | None, out: Path) -> dict[str, Any]:
    """Every repeat of every server on one model; lmserve starts first with an empty kernel cache
    (a first start on this machine), then from the one that start filled."""
    import tempfile
    print(f"bench.serve: preparing prompts from {Path(model).name}", flush=True)
    work = Workload(model, plan, nonce=int(time.time()) % 100_000)
    kernels: dict[str, Any] | None = None
    if peer_bin is not None:
        if args.quiet >= 0:
            wait_for_quiet(args.quiet, args.quiet_wait)
        kernels = peer_kernels(peer_bin, model, args.threads)
        print(f"bench.serve: {peer_kernel_line(kernels)}; lmserve's GEMM: {lmserve_gemm()}", flush=True)
    per_server: dict[str, list[RepeatFigures]] = {s: [] for s in wanted}
    loads: dict[str, list[dict[str, float]]] = {s: [] for s in wanted}
    commands: dict[str, list[str]] = {}
    notes: dict[str, dict[str, str]] = {}
    started_all = time.perf_counter()
    kernel_cache = tempfile.mkdtemp(prefix="lmserve-bench-kernels-")
    cold_start: float | None = None
    for repeat in range(repeats):
        for name in wanted:
            print(f"bench.serve: repeat {repeat + 1}/{repeats}, {name}", flush=True)
            proc = None
            sampler: MemorySampler | None = None
            before = wait_for_quiet(args.quiet, args.quiet_wait) if args.quiet >= 0 else None
            if name in external:
                base_url = external[name].rstrip("/")
            else:
                spec = (lmserve_spec(model, args.ctx, args.parallel, args.threads, args.kv_slots, kernel_cache)
                        if name == LMSERVE else peer_spec(peer_bin, model, args.ctx, args.parallel, args.threads))  # type: ignore[arg-type]
                commands[name] = spec.command
                if name == LMSERVE and cold_start is None:  # a first start: then it stops, and the repeats begin
                    first = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
                    cold_start = first.ready_after  # type: ignore[attr-defined]
                    # what a first start leaves to compile while it serves is compiled before it stops,
                    # as on a server that ran for a while: the warm starts below read a full cache
                    after = settle(first)
                    stop_server(first)
                    print(f"bench.serve:   lmserve first start (empty kernel cache) ready in {cold_start:.1f} s "
                          f"(idle {after:.0f} s later)", flush=True)
                proc = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
                base_url = spec.base_url
            try:
                sampler = MemorySampler(proc.pid if proc else None).start()
                figs = asyncio.run(run_server_repeat(base_url, work, repeat, sampler if proc else None,
                                                     args.quiet, args.quiet_wait))
            except Exception as exc:
                if proc is not None and proc.poll() is not None and proc.returncode in (-4, 132):
                    print("bench.serve: the peer died of SIGILL: rebuild it (--peer-build) with "
                          f"CMAKE_ARGS={PEER_CMAKE_ARGS!r}", file=sys.stderr)
                raise RuntimeError(f"{name}, repeat {repeat + 1}: {exc}") from exc
            finally:
                load = sampler.stop() if sampler else {}
                if proc is not None:
                    stop_server(proc)
            if proc is not None:
                figs.values["start|warm"] = proc.ready_after  # type: ignore[attr-defined]
                if name == LMSERVE and repeat == 0:
                    figs.values["start|cold"] = cold_start
            loads[name].append({**load, "other_cores_before": before} if before is not None else load)
            per_server[name].append(figs)
            if "claude-code" in figs.checks:
                failed = str(figs.checks["claude-code"]).startswith("failed")
                notes.setdefault(name, {})["claude-code"] = (figs.checks["claude-code"] if failed
                                                             else "not served (no /v1/messages)")
                notes[name]["memory"] = "n/a"
            if "other_cores" in load:
                print(f"bench.serve:   other processes used {load['other_cores']:.2f} cores on average",
                      flush=True)
            print(f"bench.serve:   checks {json.dumps(figs.checks)}", flush=True)
            write_results(out, plan, per_server, notes, run_meta(args, argv, model, repeats, peer_bin,
                                                                 commands, loads, started_all, kernels))
    shutil.rmtree(kernel_cache, ignore_errors=True)
    document = write_results(out, plan, per_server, notes,
                             run_meta(args, argv, model, repeats, peer_bin, commands, loads, started_all, kernels))
    print_report(document, out)
    return document


def run_speculation(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The speculation comparison: every variant restarted for every repeat, the repeats of the
    variants interleaved, one stream at a time."""
    import shlex

    from shared.default_model import default_model_path
    model = args.model or str(default_model_path())
    plan: EditPlan = EDIT_QUICK if args.quick else EDIT_FULL
    if args.edit_source:
        plan = dataclasses.replace(plan, source=args.edit_source)
    repeats = args.repeats or (1 if args.quick else 3)
    wanted = [s for s in args.servers.split(",") if s]
    unknown = [s for s in wanted if s not in SERVERS]
    if unknown:
        print(f"bench.serve: unknown server(s) {unknown}; names are {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    variants = speculation_variants(args.spec_max, shlex.split(args.peer_spec), wanted)
    peer_bin = ensure_peer(find_peer_build(args.peer_build)) if PEER in wanted else None
    out = Path(args.out or RESULTS / "speculation.json")
    work = Workload(model, QUICK if args.quick else FULL)
    source = edit_source(plan, work.count)
    print(f"bench.serve: edit source {source.path}, {source.tokens} tokens; renaming {source.function}", flush=True)
    per_variant: dict[str, list[RepeatFigures]] = {v.name: [] for v in variants}
    commands: dict[str, list[str]] = {}
    loads: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    started_all = time.perf_counter()
    document: dict[str, Any] = {}
    for repeat in range(repeats):
        for variant in variants:
            print(f"bench.serve: repeat {repeat + 1}/{repeats}, {variant.name}", flush=True)
            before = wait_for_quiet(args.quiet, args.quiet_wait) if args.quiet >= 0 else None
            spec = (lmserve_spec(model, args.ctx, args.parallel, args.threads, args.kv_slots, extra=variant.flags)
                    if variant.server == LMSERVE
                    else peer_spec(peer_bin, model, args.ctx, args.parallel, args.threads, variant.flags))  # type: ignore[arg-type]
            commands[variant.name] = spec.command
            proc = start_server(spec, RESULTS / f"speculation-{variant.server}.log.tmp")
            sampler = MemorySampler(proc.pid).start()
            try:
                figs = asyncio.run(run_speculation_repeat(spec.base_url, work, plan, source, repeat))
            except Exception as exc:
                raise RuntimeError(f"{variant.name}, repeat {repeat + 1}: {exc}") from exc
            finally:
                load = sampler.stop()
                stop_server(proc)
            loads[variant.name].append({**load, "other_cores_before": before} if before is not None else load)
            per_variant[variant.name].append(figs)
            print(f"bench.serve:   edit {figs.values.get('edit|decode') or 0:.1f} tok/s, prose "
                  f"{figs.values.get('prose|decode') or 0:.1f} tok/s; checks {json.dumps(figs.checks)}", flush=True)
            meta = run_meta(args, argv, model, repeats, peer_bin, commands, loads, started_all)
            meta["edit_source"] = {k: v for k, v in dataclasses.asdict(source).items() if k != "text"}
            meta["spec_max"], meta["peer_spec"] = args.spec_max, args.peer_spec
            document = write_speculation_results(out, plan, per_variant, meta)
    print_speculation_report(document)
    print(f"wrote {out}")
    return 0


def memory_floor(args: argparse.Namespace, model: str, wanted: list[str], peer_bin: Path | None) -> dict[str, Any]:
    """Both servers at their smallest useful setting (a 4096-token context, one KV slot), one
    short request: the peak memory of each (RSS and PSS sums over its processes)."""
    import httpx
    import tempfile
    figures: dict[str, dict[str, float]] = {}
    kernel_cache = tempfile.mkdtemp(prefix="lmserve-bench-kernels-")
    for name in wanted:
        spec = (lmserve_spec(model, 4096, 1, args.threads, kv_slots=1, kernel_cache=kernel_cache) if name == LMSERVE
                else peer_spec(peer_bin, model, 4096, 1, args.threads))  # type: ignore[arg-type]
        if name == LMSERVE:  # measured from a warm start: a first start's compiling is not what it holds
            first = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
            settle(first)
            stop_server(first)
        proc = start_server(spec, RESULTS / f"serve-{name}.log.tmp")
        sampler = MemorySampler(proc.pid).start()
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 16}
            httpx.post(spec.base_url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()
            time.sleep(1.0)
        finally:
            sampler.stop()
            stop_server(proc)
        figures[name] = {"rss": sampler.peak / 2**20, "pss": sampler.peak_pss / 2**20,
                         "by_process_pss": {k: round(v / 2**20, 1) for k, v in sampler.roles.items()}}
    shutil.rmtree(kernel_cache, ignore_errors=True)
    line = "smallest setting (ctx 4096, one slot, lmserve from a warm kernel cache), peak memory: " + "; ".join(
        f"{n} RSS {f['rss']:.0f} MiB, PSS {f['pss']:.0f} MiB" for n, f in figures.items())
    if LMSERVE in figures and PEER in figures:
        line += (f"; ratio RSS {figures[LMSERVE]['rss'] / figures[PEER]['rss']:.2f}, "
                 f"PSS {figures[LMSERVE]['pss'] / figures[PEER]['pss']:.2f}")
    return {"model": Path(model).name, "servers": figures, "line": line}


def run_meta(args: argparse.Namespace, argv: list[str] | None, model: str, repeats: int, peer_bin: Path | None,
             commands: dict[str, list[str]], loads: dict[str, list[dict[str, float]]],
             started_all: float, kernels: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "command": "python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "duration_s": round(time.perf_counter() - started_all),
        "machine": machine_facts(),
        "model": Path(model).name, "repeats": repeats, "quick": args.quick, "ctx": args.ctx,
        "threads": args.threads, "parallel": args.parallel, "lmserve_revision": _git_revision(),
        "peer": {"server": "llama-server", "source": f"{PEER_PACKAGE} {PEER_VERSION} sdist",
                 "version": peer_version(peer_bin) if peer_bin else None, "cmake": PEER_CMAKE_ARGS,
                 "parallel_slots": args.parallel},
        "peer_kernels": kernels,
        "server_commands": commands,
        "load": loads,
    }


if __name__ == "__main__":
    raise SystemExit(main())
