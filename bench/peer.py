"""llama.cpp, the server lmserve is measured against: its build from the llama.cpp tree vendored in
the ``llama-cpp-python`` sdist, its version, and its speed held to llama.cpp's own figures."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.machine import cpu_has_amx_int8

REPO = Path(__file__).resolve().parent.parent
PEER_PACKAGE = "llama-cpp-python"
PEER_VERSION = "0.3.36"
# GCC 12 miscompiles llama.cpp's AMX int8 matmul (SIGILL in every prompt evaluation on
# Sapphire Rapids); building without AMX int8 avoids it.
PEER_CMAKE_ARGS = "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
PEER_TARGETS = ("llama-server", "llama-bench", "llama-quantize")
PEER_BUILD_CANDIDATES = (Path("/work/peer-build"), REPO / ".bench-peer")
# llama.cpp's own single-stream decode figures for the default model on 2 cores of a Sapphire
# Rapids machine: its C++ server with the AMX int8 path working (one 256-token stream), and
# llama-bench tg128 without AMX, which is what a build with AMX int8 compiled out compares to.
# A figure far below the second means the peer is misbuilt or starved.
PEER_REFERENCES: dict[str, tuple[float, float]] = {
    "llama.cpp's C++ server, AMX int8 path": (108.0, 142.0),
    "llama-bench tg128 without AMX": (91.0, 97.0),
}
# llama-bench's pp512 / tg128 on 2 cores (tok/s), by the matmul path the CPU and build give
# (../shared/reference/peer-servers.md section 7; the AMX figures are single readings).
KERNEL_REFERENCES: dict[str, dict[str, tuple[float, float]]] = {
    "AMX int8": {"pp512": (1150.0, 1150.0), "tg128": (220.0, 220.0)},
    "without AMX": {"pp512": (200.0, 250.0), "tg128": (91.0, 97.0)},
}
KERNEL_TOLERANCE = 0.15  # "within noise": a shared 2-core machine moves these by about this much


def find_peer_build(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    for candidate in PEER_BUILD_CANDIDATES:
        if (candidate / "bin" / "llama-server").exists():
            return candidate
    return PEER_BUILD_CANDIDATES[-1]


def ensure_peer(build: Path) -> Path:
    """The directory of the peer's binaries (llama-server, llama-bench, llama-quantize), built
    into ``build`` from the llama.cpp tree of the llama-cpp-python sdist if they are missing."""
    binaries = build / "bin"
    if all((binaries / target).exists() for target in PEER_TARGETS):
        return binaries
    print(f"bench.serve: building {', '.join(PEER_TARGETS)} from the llama.cpp tree of {PEER_PACKAGE} "
          f"{PEER_VERSION} into {build} ({PEER_CMAKE_ARGS}); this takes 15-30 minutes on 2 cores",
          file=sys.stderr)
    import tarfile
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", scratch, f"{PEER_PACKAGE}=={PEER_VERSION}"], check=True)
        (sdist,) = Path(scratch).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(scratch, filter="data")
        (source,) = Path(scratch).glob("*/vendor/llama.cpp")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", *PEER_CMAKE_ARGS.split()], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                        "--target", *PEER_TARGETS], check=True)
    return binaries


@functools.cache
def peer_version(binaries: Path) -> str:
    out = subprocess.run([str(binaries / "llama-server"), "--version"], capture_output=True, text=True, check=False)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


def kernel_path(has_amx: bool, cmake_args: str) -> str:
    """Which KERNEL_REFERENCES row applies: AMX only on a CPU that has it, in a build that keeps it."""
    return "AMX int8" if has_amx and "-mno-amx-int8" not in cmake_args else "without AMX"


def peer_kernels(binaries: Path, model: str, threads: int) -> dict[str, Any]:
    """The peer build's pp512 / tg128 (tok/s) on this machine, measured by its llama-bench, and
    the reference they are held to (llama.cpp's figures are for the default model only)."""
    out = subprocess.run([str(binaries / "llama-bench"), "-m", model, "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=900)
    figures = {}
    for test in json.loads(out.stdout):
        name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        figures[name] = float(test["avg_ts"])
    path = kernel_path(cpu_has_amx_int8(), PEER_CMAKE_ARGS)
    from shared.default_model import default_model_path
    if Path(model).name != default_model_path().name:
        return {**figures, "path": path, "references": None}
    return {**figures, "path": path, "references": {k: list(v) for k, v in KERNEL_REFERENCES[path].items()}}


def peer_kernel_line(kernels: dict[str, Any]) -> str:
    """The peer's kernel speed next to llama.cpp's own figures for the same path, with a verdict.

    A peer slower than its reference is misbuilt or starved, and the comparison flatters lmserve;
    a faster one (another CPU than the reference's) only makes the comparison harder on lmserve.
    """
    if kernels.get("references") is None:
        figures = "; ".join(f"{name} {kernels[name]:.0f}" for name in ("pp512", "tg128"))
        return f"llama.cpp kernels, {kernels['path']} path, 2 cores: {figures} tok/s (no reference for this file)"
    parts, slow, fast = [], [], []
    for name in ("pp512", "tg128"):
        lo, hi = kernels["references"][name]
        value = kernels[name]
        parts.append(f"{name} {value:.0f} (reference {lo:.0f}-{hi:.0f})")
        if value < lo * (1 - KERNEL_TOLERANCE):
            slow.append(name)
        elif value > hi * (1 + KERNEL_TOLERANCE):
            fast.append(name)
    if slow:
        verdict = f"TOO SLOW in {', '.join(slow)}: misbuilt or starved, do not trust the comparison"
    elif fast:
        verdict = f"faster than the reference in {', '.join(fast)} (a faster CPU): the comparison stands"
    else:
        verdict = f"within {KERNEL_TOLERANCE:.0%} of the reference"
    return f"llama.cpp kernels, {kernels['path']} path, 2 cores: {'; '.join(parts)} tok/s: {verdict}"


def peer_sanity_line(median: float, kernels: dict[str, Any] | None = None) -> str:
    """The peer's single-stream decode through its server, next to its own kernels' tg128 when
    measured in the same run (the gap is the server's cost per token), else next to
    llama.cpp's figures for the reference machine."""
    if kernels is not None:
        return (f"llama.cpp single-stream decode through llama-server: {median:.1f} tok/s, "
                f"{median / kernels['tg128']:.0%} of its kernels' tg128 ({kernels['tg128']:.0f} tok/s) in this run")
    references = "; ".join(f"{name}: {lo:.0f}-{hi:.0f}" for name, (lo, hi) in PEER_REFERENCES.items())
    floor = min(lo for lo, _ in PEER_REFERENCES.values()) * 0.85
    verdict = "plausible" if median >= floor else "TOO LOW: misbuilt or starved?"
    return (f"llama.cpp single-stream decode: {median:.1f} tok/s ({verdict}; on 2 Sapphire Rapids cores, "
            f"{references} tok/s)")
