"""Engine speed on the default model: prefill tokens/s (512 and 2048 prompt tokens), decode
tokens/s at batch 1 and batch 8, and the process's peak memory.

    python -m bench.engine [MODEL.gguf] [--repeats N] [--threads N] [--exact] [--kv-type f16|f32]
                           [--long N]

The served path keeps the weights in the file's blocks (int8 kernels); ``--exact`` measures the
float32 path (every weight dequantized at load, BLAS products) instead, for comparison. The
last row is single-stream decode after a ``--long``-token prompt (default 4096), against which
the batch-1 row (after 128 tokens) shows what a long context costs a step.

Figures are min / median / max over the repeats. The peer's figures on the same machine
class come from ``python -m bench.serve`` (which runs both servers in one go).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from worker.engine import kernels
from worker.engine import Engine


def _spread(values: list[float]) -> str:
    return f"{min(values):8.1f} {statistics.median(values):8.1f} {max(values):8.1f}"


def measure(engine: Engine, repeats: int, long: int) -> list[tuple[str, list[float]]]:
    model = engine.model
    rng = np.random.default_rng(0)
    vocab = model.hp.n_vocab
    rows: list[tuple[str, list[float]]] = []
    for n in (512, 2048):
        tokens = rng.integers(0, vocab, n).tolist()
        speeds = []
        for _ in range(repeats):
            cache = model.new_cache(n + 8)
            started = time.perf_counter()
            engine.prefill(cache, tokens)
            speeds.append(n / (time.perf_counter() - started))
        rows.append((f"prefill {n} tokens (tok/s)", speeds))
    for batch in (1, 8):
        caches = [model.new_cache(512) for _ in range(batch)]
        for cache in caches:
            engine.prefill(cache, rng.integers(0, vocab, 128).tolist())
        speeds = []
        steps = 32
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(steps):
                model.forward([(cache, [int(rng.integers(0, vocab))]) for cache in caches])
            speeds.append(batch * steps / (time.perf_counter() - started))
            for cache in caches:
                cache.truncate(128)
        rows.append((f"decode batch {batch} (tok/s, all streams)", speeds))
    if long:
        cache = model.new_cache(long + 64)
        engine.prefill(cache, rng.integers(0, vocab, long).tolist())
        speeds = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(32):
                model.forward([(cache, [int(rng.integers(0, vocab))])])
            speeds.append(32 / (time.perf_counter() - started))
            cache.truncate(long)
        rows.append((f"decode batch 1 after {long} tokens (tok/s)", speeds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: every core)")
    parser.add_argument("--exact", action="store_true", help="float32 weights and BLAS instead of the kernels")
    parser.add_argument("--kv-type", choices=("f16", "f32"), default="f16", help="KV cache storage")
    parser.add_argument("--long", type=int, default=4096, help="context of the long decode row (0: skip it)")
    args = parser.parse_args(argv)
    from shared.default_model import default_model_path
    threads = kernels.set_threads(args.threads or None)
    started = time.perf_counter()
    engine = Engine.load(args.model or default_model_path(), exact=args.exact, kv_type=args.kv_type)
    load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    engine.warm_up()  # as a worker does before it serves: no figure below includes a compile
    warm_seconds = time.perf_counter() - started
    held = "float32 (exact path)" if args.exact else "in the file's blocks"
    print(f"model {engine.model_id} ({engine.architecture}), {engine.model.weight_bytes / 2**20:.0f} MiB "
          f"of weights held {held}, {args.kv_type} KV cache, loaded in {load_seconds:.1f} s, "
          f"kernels ready in {warm_seconds:.1f} s, {threads} threads")
    print(f"{'lmserve engine':40s} {'min':>8s} {'median':>8s} {'max':>8s}")
    for label, values in measure(engine, args.repeats, args.long):
        print(f"{label:40s} {_spread(values)}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'peak resident memory (MiB)':40s} {peak:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
