"""A first start on a CPU: the heaviest kernels compiled in parallel processes, ahead of the rest.

numba compiles a kernel on its first call and keeps it in its disk cache, one process at a
time. The leaf kernels (the attention's tasks over the cache's type and their callers, the GEMM
of each block type of the layers' matrices, the head's) take most of a first start and need
nothing of the model but those types, so ``start`` hands them to helper processes (as many as
there are cores, the jobs balanced by what they cost) as soon as a file's header is read, and
they compile while the model loads. The warm-up compiles the block steps around the GEMMs as
soon as those are done (``wait_for_matrices``), and the rest once the attention is (``wait``);
they read the leaves from the cache.

Each helper marks what it compiled (a file in numba's cache directory, which is per version
of the kernel sources, named for the CPU), so a later start spawns nothing. A helper that fails
costs only time: the warm-up then compiles that kernel itself.

The block steps around the leaves (``fused.py``, the norms, the head) compile in the warm-up
itself, once for each combination of an architecture, its weights' types and the cache's
(``steps_job``): the warm-up marks that combination when it is done, so a start whose leaves
are all cached but whose combination is new still says it compiles.

    python -c "$HELPER" gemm:Q4_K rows:Q8_0 attention-loops:f16   (what a helper runs: ``main``)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KV_DTYPES = {"f16": np.uint16, "f32": np.float32}  # a cache's arrays as the kernels read them
HELPER = "import sys; from worker.engine.compile_ahead import main; sys.exit(main(sys.argv[1:]))"


def _cpu() -> str:
    """The CPU the kernels compile for, as numba keys its cache by it."""
    import numba
    from llvmlite import binding

    from worker.engine.kernels import target_features

    features = ",".join(sorted(k for k, v in target_features().items() if v))
    name = numba.config.CPU_NAME or binding.get_host_cpu_name()
    return f"{name}-{hashlib.sha256(features.encode()).hexdigest()[:12]}"


def _marker(job: str) -> Path:
    import numba

    from worker.engine import kernels  # noqa: F401 - sets numba's cache directory

    return Path(numba.config.CACHE_DIR) / f"compiled-{_cpu()}-{job.replace(':', '-')}"


def compile_job(job: str) -> None:
    """Compile one leaf kernel on tiny inputs of the types the engine passes it, then mark it."""
    from worker.engine import kernels

    # a parallel kernel that another one calls, when both come from numba's disk cache (compiled
    # by an earlier process that did not mark them), needs the thread pool running (numba issue 8578)
    kernels.start_threads()
    kind, _, what = job.partition(":")
    if kind in ATTENTION_TASKS:
        from worker.engine.kernels import attention

        task = getattr(attention, ATTENTION_TASKS[kind])
        task.compile(attention.task_signature(KV_DTYPES[what], tiles=kind == "attention-tiles"))
    elif kind == "attention":  # compiled, not run: it would call its tasks, compiled apart
        from numba import typeof

        from worker.engine.kernels import attention
        from worker.engine.kv_cache import key_runs

        dtype = KV_DTYPES[what]
        q, k, v = (np.zeros((2, 2, 16), np.float32) for _ in range(3))
        keys, values = key_runs(np.zeros((2, 8, 16), dtype)), np.zeros((2, 8, 16), dtype)
        arguments = (q, k, v, keys, values, 0, np.float32(1.0), 0, np.float32(0.0), np.zeros((2, 32), np.float32),
                     False, (0, 0))
        attention.store_and_attend.compile(tuple(map(typeof, arguments)))
    elif kind in ("gemm", "rows"):
        from worker.engine import panels
        from worker.engine.kernels.activations import QuantizedActivations
        from worker.engine.weights import FEW_ROWS_KERNELS, GEMM_KERNELS

        qtype = _block_type(what)
        weights = panels.FORMATS[qtype][0]
        acts = QuantizedActivations(np.zeros((1, weights), np.float32))
        packed = np.zeros((1, 1), panels.block_dtype(qtype, rows=kind == "rows"))
        (GEMM_KERNELS if kind == "gemm" else FEW_ROWS_KERNELS)[qtype](packed, *acts.parts, np.zeros((1, 1), np.float32))
    else:
        raise ValueError(f"unknown kernel job {job!r}")
    _marker(job).touch()


# The attention's tasks, each a job of its own beside their callers' ("attention:<cache type>"),
# which call them where they are compiled (``attention.task_addresses``), not linked in.
ATTENTION_TASKS = {"attention-loops": "_attend_task", "attention-tiles": "_attend_task_tiles"}


def _block_type(name: str):
    from gguf import GGMLQuantizationType

    from worker.engine import q2_0

    return q2_0.Layout[name] if name in q2_0.Layout.__members__ else GGMLQuantizationType[name]


def describe(jobs: list[str]) -> str:
    """What the jobs compile, for a person: "attention over an f16 cache, Q4_K and Q6_K matrices"."""
    parts = [f"attention over an {job.partition(':')[2]} cache" for job in jobs if job.startswith("attention:")]
    types = [job.partition(":")[2] for job in jobs if job.startswith("gemm:")]
    if types:
        parts.append(" and ".join([", ".join(types[:-1]), types[-1]] if len(types) > 1 else types) + " matrices")
    rows = [job.partition(":")[2] for job in jobs if job.startswith("rows:")]
    if rows:
        parts.append(" and ".join(rows) + " matrices without the tile loop")
    parts += [f"the {job.partition(':')[2].partition('-')[0]} block steps for these weight types"
              for job in jobs if job.startswith("steps:")]
    return ", ".join(parts)


def steps_job(architecture: str, held: list, kv_type: str) -> str:
    """The job naming the block steps a model compiles in its warm-up: its architecture, and a
    digest of how its weights are held (the kind and type of each: numba compiles a function
    once per combination of argument types) and of its cache's type."""
    kinds = sorted(map(_held_as, held))
    digest = hashlib.sha256(repr((kv_type, kinds)).encode()).hexdigest()[:12]
    return f"steps:{architecture}-{digest}"


def _held_as(weight) -> str:
    """How numba sees a held weight: an array's type and rank, or a weight's kind, its block type
    (a weight held as float32 has none) and rank, and its panels' record type, which names the GEMM."""
    if isinstance(weight, np.ndarray):
        return f"{weight.dtype}/{weight.ndim}"
    qtype = getattr(weight, "qtype", None)
    panels = getattr(weight, "panels", None)
    record = panels.dtype.names[0] if panels is not None else ""
    return f"{type(weight).__name__}:{getattr(qtype, 'name', qtype)}:{record}/{len(weight.shape)}"


def pending(job: str) -> bool:
    return not _marker(job).exists()


def mark_done(job: str) -> None:
    _marker(job).touch()


def forget(job: str) -> None:
    """Unmark a job: the next start takes it as a first start would (what it finds in numba's
    cache, it loads)."""
    _marker(job).unlink(missing_ok=True)


def leaf_jobs(layer_weights: dict, head_type, kv_type: str) -> list[str]:
    """The leaf kernels not yet compiled that a model needs: attention over its cache's type
    (its tasks, ``ATTENTION_TASKS``, and their callers), and the GEMM of each block type of its
    layers' matrices (``layer_weights``: weights of each) and of its head (None: a head without
    panels), each of its kind (``weights.kernel_kind``)."""
    from worker.engine.kernels import attention
    from worker.engine.weights import kernel_kind

    kinds = {(t, kernel_kind(t, layer_weights)) for t in layer_weights}
    if head_type is not None:
        kinds.add((head_type, kernel_kind(head_type, layer_weights)))
    attend = f"attention:{kv_type}"
    tasks = [f"attention-loops:{kv_type}"] + [f"attention-tiles:{kv_type}"] * attention.TILED
    matrices = [f"{kind}:{getattr(t, 'name', t)}" for t, kind in sorted(kinds, key=lambda k: (int(k[0]), k[1]))]
    jobs = (tasks + [attend] if pending(attend) else []) + matrices
    return [job for job in jobs if pending(job)]


# What a job costs to compile on one core, in units of one block type's GEMM (measured on a
# 2-core Xeon: about 3.3 s a GEMM, 9 s for Q8_0's with its tile loop, some 3 s more for a
# helper's first GEMM, which brings the activations' quantizers along; the attention's float32
# task 7 s, its tile task 4 s, their callers 1.5 s).
ATTENTION_COSTS = {"attention-loops": 2.1, "attention-tiles": 1.2, "attention": 0.5}
TILED_COST, QUANTIZERS_COST = 2.7, 1.0
ATTENTION_NICENESS = 10


def job_cost(job: str) -> float:
    """A job's cost in those units: a GEMM with the tile loop where this CPU takes the tiles."""
    from worker.engine.kernels import use_tiles
    from worker.engine.weights import FEW_ROWS_KERNELS

    kind, _, what = job.partition(":")
    if kind in ATTENTION_COSTS:
        return ATTENTION_COSTS[kind]
    return TILED_COST if kind == "gemm" and _block_type(what) in FEW_ROWS_KERNELS and use_tiles() else 1.0


def shares(jobs: list[str], cores: int) -> list[list[str]]:
    """The jobs of each helper, one helper a core at most, balanced by what each costs (the
    costliest first, each to the helper with least to do). A helper compiles its matrices before
    the attention: the block steps around them (``DecoderModel.warm_products``) compile here as
    soon as every GEMM is done, while the attention still compiles there. The attention's jobs
    run ATTENTION_NICENESS lower in priority (``main``): nothing waits for them before the
    steps are done, so while the model loads and the GEMMs and steps compile they take what
    cores those leave (a first start of a Qwen3-0.6B-shaped Q8_0 file on 2 cores of a Xeon:
    about 1 s sooner, alternating)."""
    helpers: list[list[str]] = [[] for _ in range(max(1, min(cores, len(jobs))))]

    def load(share: list[str]) -> float:
        return sum(map(job_cost, share)) + QUANTIZERS_COST * any(_matrix(j) for j in share)

    for job in sorted(jobs, key=job_cost, reverse=True):
        min(helpers, key=lambda share: load(share + [job])).append(job)
    return [sorted(share, key=lambda job: not _matrix(job)) for share in helpers if share]


def _matrix(job: str) -> bool:
    return not job.startswith("attention")


@dataclass
class CompileAhead:
    """Helper processes compiling leaf kernels; ``wait`` before the first forward pass."""

    jobs: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, layer_weights: dict, head_type, kv_type: str, cores: int | None = None) -> CompileAhead:
        jobs = leaf_jobs(layer_weights, head_type, kv_type)
        ahead = cls(jobs)
        if not jobs:
            return ahead
        cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
        for share in shares(jobs, cores):
            ahead.processes.append(subprocess.Popen([sys.executable, "-c", HELPER, *share], env=env,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return ahead

    def wait_for_matrices(self) -> None:
        """Wait until every GEMM is compiled: marked, or its helper gone (one that failed leaves
        its kernels to the warm-up). The attention may still be compiling."""
        for process in self.processes:
            matrices = [job for job in process.args[3:] if _matrix(job)]
            while process.poll() is None and any(pending(job) for job in matrices):
                time.sleep(0.05)

    def wait(self) -> float:
        """Join the helpers; returns how long they took since ``start``."""
        for process in self.processes:
            process.wait()
        return time.monotonic() - self.started


def main(argv: list[str]) -> int:
    """Compile each job in turn, the attention's at a lower priority (``shares``)."""
    lowered = False
    for job in argv:
        if not _matrix(job) and not lowered:
            os.nice(ATTENTION_NICENESS)  # an increment, which any process may take
            lowered = True
        compile_job(job)
    return 0
