"""Regenerate the MTP draft fixtures: llama.cpp's ``draft-mtp`` drafts on the tiny MTP models.

How to regenerate (from the repo root; any Python with numpy, gguf, tokenizers and numba, as
for tests/tiny_models.py, and a llama.cpp build whose llama-server has ``--spec-type draft-mtp``):

    .venv/bin/python scripts/regen_mtp_fixtures.py --llama-server BUILD/bin/llama-server
    .venv/bin/python scripts/regen_mtp_fixtures.py --llama-server … qwen35_mtp   # just one

llama-server shows its drafts only in its debug log: at ``-v`` the MTP drafter logs, for every
draft step of every round, its three best candidates and their probabilities (after its top-10
sampler), and the server logs how many of each round's drafts it verified and kept. For each
tiny model of ``tiny_models.MTP_FIXTURES`` and each prompt below, one server (one slot, F32 KV
cache, no flash attention, two threads) writes a greedy reply; a fresh server per prompt, since
the drafter carries the last state of a sequence over to the next request of its slot.

What it writes, one ``tests/fixtures/mtp_drafts_<name>.npz`` per model, per prompt k:
``prompt_k`` [P], ``reply_k`` [N] (the greedy reply), and per draft round r ``draft_ids_k`` /
``draft_probs_k`` [R, steps, 3] (each step's three best candidates, best first),
``verified_k`` [R] (drafts the server sent to the target, after its own length limits) and
``accepted_k`` [R] (how many of them the target kept); plus ``meta``, a JSON string with the
server build, its flags and how to rebuild the model file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from fixture_files import FIXTURE_DIR, sha256_of, write_npz  # noqa: E402
import tiny_models  # noqa: E402

TINY_SEED = 0
PROMPT_SEED = 1234
REPLY_TOKENS = 24
DRAFT_MAX = 3  # the server's default --spec-draft-n-max
SERVER_FLAGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(DRAFT_MAX), "-c", "256", "-np", "1",
                "-t", "2", "-tb", "2", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--no-warmup", "-v"]

CANDIDATE = re.compile(rb"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([0-9.eE+-]+)\)")
ACCEPTED = re.compile(rb"accepted (\d+)/(\d+) draft tokens")


def prompts(n_vocab: int) -> list[list[int]]:
    """A short prompt of spread-out ids, and 40 random ones (a longer catch-up of the MTP KV)."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [[1000 * (i + 1) for i in range(8)], [int(t) for t in rng.integers(0, n_vocab, size=40)]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def serve_once(server: str, model: Path, prompt: list[int], log_path: Path) -> tuple[list[int], bytes]:
    """One greedy reply from a fresh llama-server; returns its tokens and the server's log."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([server, "-m", str(model), "--port", str(port), *SERVER_FLAGS],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({process.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up; see {log_path}")
            time.sleep(0.5)
        reply = post(f"http://127.0.0.1:{port}/completion",
                     {"prompt": prompt, "n_predict": REPLY_TOKENS, "temperature": 0, "cache_prompt": False,
                      "return_tokens": True})
    finally:
        process.terminate()
        process.wait(timeout=60)
    timings = reply["timings"]
    print(f"  prompt of {len(prompt)}: draft_n {timings.get('draft_n')}, "
          f"accepted {timings.get('draft_n_accepted')}")
    return [int(t) for t in reply["tokens"]], log_path.read_bytes()


def draft_rounds(log: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each verified round's candidates [R, steps, 3] (ids, probabilities), drafts verified and
    kept [R], from the server's debug log (a round without a verification is left out)."""
    rounds: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in log.splitlines():
        if match := CANDIDATE.search(line):
            rank, step, token, prob = int(match[1]), int(match[2]), int(match[3]), float(match[4])
            if rank == 0 and step == 0:
                current = {"ids": [], "probs": []}
            if current is None:
                raise ValueError(f"a draft candidate outside a round: {line!r}")
            if rank == 0:
                current["ids"].append([])
                current["probs"].append([])
            current["ids"][step].append(token)
            current["probs"][step].append(prob)
        elif (match := ACCEPTED.search(line)) and current is not None:
            current["accepted"], current["verified"] = int(match[1]), int(match[2])
            rounds.append(current)
            current = None
    if any(len(step) != 3 for r in rounds for step in r["ids"]) or any(len(r["ids"]) != DRAFT_MAX for r in rounds):
        raise ValueError("expected three candidates for each of the draft steps of every round")
    return (np.asarray([r["ids"] for r in rounds], dtype=np.int32),
            np.asarray([r["probs"] for r in rounds], dtype=np.float32),
            np.asarray([r["verified"] for r in rounds], dtype=np.int32),
            np.asarray([r["accepted"] for r in rounds], dtype=np.int32))


def regenerate(name: str, server: str, scratch: Path) -> Path:
    print(f"{name}:")
    arch, overrides = tiny_models.MTP_FIXTURES[name]
    info = tiny_models.write_tiny_gguf(scratch / f"{name}.gguf", arch, seed=TINY_SEED, **overrides)
    model = Path(info["path"])
    arrays: dict[str, np.ndarray] = {}
    for k, prompt in enumerate(prompts(info["n_vocab"])):
        reply, log = serve_once(server, model, prompt, scratch / f"{name}-{k}.log")
        ids, probs, verified, accepted = draft_rounds(log)
        arrays |= {f"prompt_{k}": np.asarray(prompt, np.int32), f"reply_{k}": np.asarray(reply, np.int32),
                   f"draft_ids_{k}": ids, f"draft_probs_{k}": probs, f"verified_{k}": verified,
                   f"accepted_{k}": accepted}
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    meta = {
        "name": name,
        "reference": "llama.cpp llama-server --spec-type draft-mtp (debug log)",
        "reference_version": " / ".join(line for line in version if line.startswith(("version", "built"))),
        "server_flags": SERVER_FLAGS,
        "request": {"n_predict": REPLY_TOKENS, "temperature": 0, "cache_prompt": False},
        "model": {"kind": "tiny_models.write_tiny_gguf", "arch": arch, "seed": TINY_SEED, "overrides": overrides,
                  "sha256": sha256_of(model)},
        "prompts": {"count": len(prompts(info["n_vocab"])), "random_seed": PROMPT_SEED},
    }
    arrays["meta"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
    path = FIXTURE_DIR / f"mtp_drafts_{name}.npz"
    write_npz(path, arrays)
    print(f"  wrote {path.relative_to(REPO_ROOT)}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"fixtures to rebuild (default: all of {list(tiny_models.MTP_FIXTURES)})")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                        help="the llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")
    args = parser.parse_args(argv)
    if not args.llama_server:
        parser.error("no llama-server: give --llama-server or set LLAMA_SERVER")
    unknown = sorted(set(args.names) - set(tiny_models.MTP_FIXTURES))
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; choose from {list(tiny_models.MTP_FIXTURES)}")
    with tempfile.TemporaryDirectory(prefix="mtp-fixtures-") as scratch:
        for name in args.names or tiny_models.MTP_FIXTURES:
            regenerate(name, args.llama_server, Path(scratch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
