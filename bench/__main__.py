"""Every benchmark in one go: ``python -m bench [--quick] [--only engine,serve]``.

Runs, one after another and each in its own process (so one's memory and threads do not bleed
into the next), bench.engine, bench.worker, bench.serve, bench.prefix, bench.grammar and bench.route, and
prints their figures as they come. A benchmark this checkout does not have is skipped with a
note. Each of them also runs alone: ``python -m bench.serve --help``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHES = ("engine", "worker", "serve", "prefix", "grammar", "route")
# Flags for a smoke run, per benchmark (the others take their defaults).
QUICK_FLAGS: dict[str, list[str]] = {
    "engine": ["--repeats", "1"],
    "worker": ["--repeats", "1", "--tokens", "16"],
    "serve": ["--quick"],
    "route": ["--conversations", "4", "--turns", "3"],
}
REPEATABLE = ("engine", "worker", "serve")  # the ones that take --repeats


def command(name: str, quick: bool, repeats: int | None) -> list[str]:
    """The command line that runs one benchmark."""
    flags = list(QUICK_FLAGS.get(name, [])) if quick else []
    if repeats is not None and name in REPEATABLE:
        if "--repeats" in flags:
            at = flags.index("--repeats")
            del flags[at:at + 2]
        flags += ["--repeats", str(repeats)]
    return [sys.executable, "-m", f"bench.{name}", *flags]


def available(name: str) -> bool:
    return importlib.util.find_spec(f"bench.{name}") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every benchmark")
    parser.add_argument("--repeats", type=int, help="repeats for engine, worker and serve")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHES)}")
    args = parser.parse_args(argv)
    chosen = [n for n in (args.only.split(",") if args.only else BENCHES) if n]
    unknown = [n for n in chosen if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    summary: list[tuple[str, str]] = []
    for name in chosen:
        if not available(name):
            print(f"== bench.{name}: not in this checkout, skipped\n", flush=True)
            summary.append((name, "skipped (missing)"))
            continue
        cmd = command(name, args.quick, args.repeats)
        print(f"== bench.{name}: {' '.join(cmd[1:])}", flush=True)
        started = time.perf_counter()
        code = subprocess.run(cmd, cwd=REPO, check=False).returncode
        seconds = time.perf_counter() - started
        summary.append((name, f"{'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s"))
        print(flush=True)
    print("== summary")
    for name, outcome in summary:
        print(f"  bench.{name:8s} {outcome}")
    return 0 if all(not o.startswith("FAILED") for _, o in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
