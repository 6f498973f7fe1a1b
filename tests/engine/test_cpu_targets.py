"""The kernels on a CPU with AVX2 and nothing newer, on whatever CPU runs the suite.

numba compiles for the CPU ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` name, and every choice
the kernels make by feature (the vector width, VNNI or ``maddubs``) follows the same target
(``kernels.target_features``). So a Haswell's code (8-lane panels, no VNNI, no AVX-512) runs
here too: the GEMM and attention tests run again in a process compiling for it, in a cache
directory of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.engine import kernels

HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,"
           "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")


@pytest.mark.skipif(not kernels.available(), reason="the kernels need AVX2, FMA and F16C")
def test_the_kernels_on_an_avx2_cpu(tmp_path):
    here = os.path.dirname(__file__)
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL,
           "NUMBA_CACHE_DIR": str(tmp_path / "kernels")}
    check = subprocess.run([sys.executable, "-c", "from worker.engine.kernels import wide_simd, simd; "
                            "print(wide_simd.PANEL, wide_simd.HAS_VNNI, simd.HAS_VNNI)"],
                           env=env, capture_output=True, text=True, check=True)
    assert check.stdout.split() == ["8", "False", "False"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(here, "test_gemm.py"), os.path.join(here, "test_attention.py")],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
