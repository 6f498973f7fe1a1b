"""Kernels compiled by different processes into one disk cache, then loaded side by side.

numba names a compiled function by its qualified name, a counter of the functions its process
has compiled and its argument types, a record type by another counter of that process (numba
issue 10486). Two processes that compile the same calls in the same order (the compile-ahead
helpers, two starts on two files) name different code alike; a third process that loads both
from the cache links one name to one body, and a product of one weight type ran the kernel of
another (NaN logits on a Q8_0 model after a gemma-3-270m had run). Each process here is a fresh
interpreter on one cache directory, as the helpers and later starts are.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.engine import kernels

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")

# One block step (x += down(silu(h Wgᵀ) · h Wuᵀ), h = RMSNorm(x): ``fused.swiglu``) on weights of each
# named type, against the same step on gguf's dequantized weights in float64; prints the largest
# error of each as a share of the largest value.
CHILD = """
import sys
import numpy as np
from gguf import GGMLQuantizationType, quants
from worker.engine.kernels import fused
from worker.engine.weights import QuantizedWeight

def weight(rng, qtype, shape):
    dense = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
    raw = quants.quantize(dense, qtype)
    return QuantizedWeight(qtype, shape, raw).packed().kernel_array, quants.dequantize(raw, qtype).astype(np.float64)

for name in sys.argv[1:]:
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(7)
    (wg, g), (wu, u), (wd, d) = (weight(rng, qtype, shape) for shape in ((192, 64), (192, 64), (64, 192)))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = fused.swiglu(x.copy(), np.ones(64, np.float32), np.float32(1e-6), wg, wu, wd, 192)
    h = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6)
    a, b = h @ g.T, h @ u.T
    expected = x + (a / (1 + np.exp(-a)) * b) @ d.T
    error = np.abs(got - expected).max() / np.abs(expected).max()
    print(name, "nan" if not np.isfinite(error) else f"{error:.6f}")
"""


def _run(cache: str, *types: str) -> dict[str, float]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, "-c", CHILD, *types], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: float(error) for name, error in (line.split() for line in done.stdout.split("\n") if line)}


def test_steps_compiled_by_two_processes_run_their_own_kernels_when_one_process_loads_both(tmp_path):
    cache = str(tmp_path / "kernels")
    # A first process caches what every weight type shares; the next two then compile the same
    # calls in the same order, each on its own type: the same counters in both processes.
    warm = _run(cache, "Q4_1")
    alone = {**_run(cache, "Q4_0"), **_run(cache, "Q5_0")}
    for order in (("Q4_0", "Q5_0"), ("Q5_0", "Q4_0")):
        together = _run(cache, *order)
        assert set(together) == set(order)
        for name, error in together.items():
            # int8 rounding of the activations: about 1%; another type's kernel: garbage or NaN
            assert error < 0.03, f"{name} after {order[0]}: {error} of the largest value off, {alone[name]} alone"
    assert max(warm.values()) < 0.03 and max(alone.values()) < 0.03, (warm, alone)
