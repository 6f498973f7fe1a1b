"""Worker throughput: aggregate decode tokens/s with 1, 4 and 8 concurrent streams, a worker
started with ``--batch 8`` side by side with the same streams on a sequential worker.

    python -m bench.worker [MODEL.gguf] [--tokens 64] [--repeats 2]

Both workers are real ``lmserve worker`` processes driven over ZeroMQ; every stream has its
own short prompt and generates exactly --tokens tokens (end-of-turn tokens are masked off).
Figures are min / median / max over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gateway.worker_client import WorkerClient
from shared.protocol import Finished, Generate
from shared.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _run_streams(client: WorkerClient, streams: int, tokens: int) -> float:
    async def one(i: int) -> int:
        request = Generate(client.new_request_id(), [1, 28, 400 + i, 900 + i, 42], SamplingParams(temperature=0.0),
                           tokens, stop_ids=[])
        async for message in client.generate(request):
            if isinstance(message, Finished):
                return message.completion_tokens
        return 0

    started = time.perf_counter()
    produced = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(produced) / (time.perf_counter() - started)


async def _measure(endpoint: str, tokens: int, repeats: int) -> dict[int, list[float]]:
    client = WorkerClient(endpoint)
    await client.start()
    await client.wait_ready(300)
    try:
        await _run_streams(client, 1, 4)  # warm-up
        return {n: [await _run_streams(client, n, tokens) for _ in range(repeats)] for n in (1, 4, 8)}
    finally:
        await client.close()


def _start(model: str | None, *flags: str) -> tuple[subprocess.Popen, str]:
    endpoint = _endpoint()
    args = [sys.executable, "-m", "launcher.cli", "worker", *([model] if model else []), "--worker", endpoint,
            "--queue", "16", *flags]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), endpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results = {}
    for label, flags in (("--batch 8", ("--batch", "8")), ("sequential", ())):
        proc, endpoint = _start(args.model, *flags)
        try:
            results[label] = asyncio.run(_measure(endpoint, args.tokens, args.repeats))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"aggregate decode tokens/s, {args.tokens} tokens per stream (min / median / max)")
    print(f"{'streams':>8s} {'--batch 8':>26s} {'sequential':>26s} {'ratio':>7s}")
    for n in (1, 4, 8):
        cells = []
        for label in ("--batch 8", "sequential"):
            v = results[label][n]
            cells.append(f"{min(v):7.1f} {statistics.median(v):7.1f} {max(v):7.1f}")
        ratio = statistics.median(results["--batch 8"][n]) / statistics.median(results["sequential"][n])
        print(f"{n:8d} {cells[0]:>26s} {cells[1]:>26s} {ratio:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
