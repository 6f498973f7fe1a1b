"""A first start on a CPU: the heaviest kernels compiled in parallel processes, ahead of the rest.

numba compiles a kernel on its first call and keeps it in its disk cache, one process at a
time. The leaf kernels (the attention over the cache's type, and the GEMM of each block type
the file holds) take most of a first start and need nothing of the model but those types, so
``start`` hands them to helper processes (as many as there are cores) as soon as a file's
header is read, and they compile while the model loads; ``wait`` joins them before the
warm-up compiles the block steps around them, which then read the leaves from the cache.

Each helper marks what it compiled (a file in numba's cache directory, which is per version
of the kernel sources, named for the CPU), so a later start spawns nothing. A helper that fails
costs only time: the warm-up then compiles that kernel itself.

The block steps around the leaves (``fused.py``, the norms, the head) compile in the warm-up
itself, once for each combination of an architecture, its weights' types and the cache's
(``steps_job``): the warm-up marks that combination when it is done, so a start whose leaves
are all cached but whose combination is new still says it compiles.

    python -c "$HELPER" attention:f16 gemm:Q4_K …   (what a helper runs: ``main``)
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
    kind, _, what = job.partition(":")
    if kind == "attention":
        from worker.engine.kernels import attention

        dtype = KV_DTYPES[what]
        q, k, v = (np.zeros((2, 2, 16), np.float32) for _ in range(3))
        keys, values = np.zeros((2, 8, 16), dtype), np.zeros((2, 8, 16), dtype)
        attention.store_and_attend(q, k, v, keys, values, 0, np.float32(1.0), 0, np.float32(0.0),
                                   np.zeros((2, 32), np.float32))
    elif kind == "gemm":
        from gguf import GGMLQuantizationType

        from worker.engine import panels, q2_0
        from worker.engine.kernels.activations import QuantizedActivations
        from worker.engine.weights import GEMM_KERNELS

        qtype = q2_0.Layout[what] if what in q2_0.Layout.__members__ else GGMLQuantizationType[what]
        weights = panels.FORMATS[qtype][0]
        acts = QuantizedActivations(np.zeros((1, weights), np.float32))
        packed = np.zeros((1, 1), panels.block_dtype(qtype))
        GEMM_KERNELS[qtype](packed, *acts.parts, np.zeros((1, 1), np.float32))
    else:
        raise ValueError(f"unknown kernel job {job!r}")
    _marker(job).touch()


def describe(jobs: list[str]) -> str:
    """What the jobs compile, for a person: "attention over an f16 cache, Q4_K and Q6_K matrices"."""
    parts = [f"attention over an {job.partition(':')[2]} cache" for job in jobs if job.startswith("attention:")]
    types = [job.partition(":")[2] for job in jobs if job.startswith("gemm:")]
    if types:
        parts.append(" and ".join([", ".join(types[:-1]), types[-1]] if len(types) > 1 else types) + " matrices")
    parts += [f"the {job.partition(':')[2].partition('-')[0]} block steps for these weight types"
              for job in jobs if job.startswith("steps:")]
    return ", ".join(parts)


def steps_job(architecture: str, held: list, kv_type: str) -> str:
    """The job naming the block steps a model compiles in its warm-up: its architecture, and a
    digest of how its weights are held (the kind and type of each: numba compiles a function
    once per combination of argument types) and of its cache's type."""
    kinds = sorted({f"{w.dtype}/{w.ndim}" if isinstance(w, np.ndarray) else
                    f"{type(w).__name__}:{getattr(w.qtype, 'name', w.qtype)}/{len(w.shape)}" for w in held})
    digest = hashlib.sha256(repr((kv_type, kinds)).encode()).hexdigest()[:12]
    return f"steps:{architecture}-{digest}"


def pending(job: str) -> bool:
    return not _marker(job).exists()


def mark_done(job: str) -> None:
    _marker(job).touch()


def leaf_jobs(packed_types, kv_type: str) -> list[str]:
    """The leaf kernels a model of these block types and cache type needs, not yet compiled."""
    jobs = [f"attention:{kv_type}"] + [f"gemm:{getattr(t, 'name', t)}" for t in sorted(packed_types, key=int)]
    return [job for job in jobs if not _marker(job).exists()]


def shares(jobs: list[str], cores: int) -> list[list[str]]:
    """The jobs of each helper, one helper a core at most. The attention kernel alone takes
    about as long as all the GEMMs: it has a helper to itself, and the GEMMs share the others."""
    helpers = max(1, min(cores, len(jobs)))
    first, rest = (jobs[:1], jobs[1:]) if helpers > 1 and jobs[0].startswith("attention:") else ([], jobs)
    others = helpers - len(first)
    return [share for share in (first, *(rest[i::others] for i in range(others))) if share]


@dataclass
class CompileAhead:
    """Helper processes compiling leaf kernels; ``wait`` before the first forward pass."""

    jobs: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, packed_types, kv_type: str, cores: int | None = None) -> CompileAhead:
        jobs = leaf_jobs(packed_types, kv_type)
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
        """Join the helpers that compile no attention kernel (the GEMMs, the sooner done)."""
        for process in self.processes:
            if not any(job.startswith("attention:") for job in process.args[3:]):
                process.wait()

    def wait(self) -> float:
        """Join the helpers; returns how long they took since ``start``."""
        for process in self.processes:
            process.wait()
        return time.monotonic() - self.started


def main(argv: list[str]) -> int:
    for job in argv:
        compile_job(job)
    return 0
