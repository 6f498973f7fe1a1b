"""Facts of the machine a run is measured on, and waiting until the rest of it is nearly idle."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.faults import cpu_flags


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_has_amx_int8() -> bool:
    return "amx_int8" in cpu_flags()


_GEMM_PROBE = """
from worker.engine import kernels
print("AMX tiles for 16-row blocks" if kernels.available() and kernels.use_tiles() else "vectors")
"""


@functools.cache
def lmserve_gemm() -> str:
    """Which loops lmserve's GEMM takes on this machine: the tile unit (AMX) for blocks of 16
    rows, or the vector loops alone (``worker.engine.kernels.use_tiles``). Asked of a child
    process: the bench's own process keeps numba and LLVM out, as its pages of LLVM's library
    would stay resident in the worker it measures (see ``worker.engine``)."""
    done = subprocess.run([sys.executable, "-c", _GEMM_PROBE], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return done.stdout.strip()


def machine_facts() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "cpu_flags": sorted(cpu_flags()), "lmserve_gemm": lmserve_gemm()}


def wait_for_quiet(threshold: float, max_wait: float, probe: float = 5.0) -> float:
    """Wait until the machine's other processes use at most ``threshold`` cores (or max_wait
    seconds pass); return the last reading. Run between servers, so nothing of ours is busy."""
    import psutil
    waited = 0.0
    while True:
        busy = psutil.cpu_percent(interval=probe) / 100.0 * (os.cpu_count() or 1)
        if busy <= threshold or waited >= max_wait:
            if busy > threshold:
                print(f"bench.serve:   the machine is still busy ({busy:.2f} cores used by others) after "
                      f"{waited:.0f} s; measuring anyway", flush=True)
            return busy
        if waited == 0:
            print(f"bench.serve:   other processes use {busy:.2f} cores; waiting up to {max_wait:.0f} s for "
                  "a quieter machine", flush=True)
        time.sleep(10)
        waited += 10 + probe
