"""Compiled kernels (numba) over GGML's block formats: int8 dot products, float lanes.

The kernels are built on the 256-bit operations of ``simd.py`` and need AVX2, FMA and F16C;
``available()`` says whether this CPU has them (otherwise the engine holds float32 weights and
multiplies with BLAS). Compiled code is cached on disk (numba's cache, keyed by the CPU), so
only a process's first start on a machine compiles (see ``_use_cache_of_these_sources``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
from pathlib import Path

REQUIRED_FEATURES = ("avx2", "fma", "f16c")


def cache_directory(sources: list[Path], base: str, tiles: bool = False) -> str:
    """Where numba caches the kernels compiled from ``sources``: ``base`` joined with a hash of
    their names and contents, and of whether they use the tile unit (``use_tiles``: a choice
    numba's own cache key, the CPU, does not tell).

    numba tells a stale cached kernel by its own file's contents only, but the kernels here
    inline functions of other files (``simd.py``'s operations, ``blocks.py``'s decoders): after
    an update that changed only those, a kernel would load code compiled against the old ones.
    A directory per version of the whole package leaves no such mix."""
    digest = hashlib.sha256()
    for source in sorted(sources):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    if tiles:
        digest.update(b"tiles")
    return os.path.join(base, digest.hexdigest()[:16])


def _use_cache_of_these_sources() -> None:
    """Under lmserve's cache (``$LMSERVE_CACHE``), or ``$NUMBA_CACHE_DIR`` where that is set, so a
    read-only install caches too. Runs before any kernel module is imported: numba fixes a
    function's cache place when it is decorated."""
    import numba

    from shared.default_model import cache_dir

    base = os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "kernels")
    numba.config.CACHE_DIR = cache_directory(list(Path(__file__).parent.glob("*.py")), base, use_tiles())
    _name_compiled_functions_apart()


def _name_compiled_functions_apart() -> None:
    """Give each function numba compiles a random id instead of its process's count.

    numba names compiled code by the function's qualified name, that id and its argument types
    (a record type by another count of its process), and cached code keeps those names (numba
    issue 10486). Processes that compile the same calls in the same order, as the compile-ahead
    helpers and two starts on two files do, give different code one name; a process that loads
    both from the cache links the name to one body, and a step on one weight type ran another
    type's product (NaN logits from a Q8_0 model in a process that had run gemma-3-270m). 63 random bits per
    function make the names of different processes differ."""
    from numba.core.bytecode import FunctionIdentity

    FunctionIdentity._unique_ids = iter(functools.partial(secrets.randbits, 63), None)


@functools.cache
def target_features() -> dict[str, bool]:
    """The CPU features the kernels compile for: the host's, or those numba is told to target
    (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, e.g. an AVX2-only CPU on an AVX-512 one), so
    that every choice made by feature (vector width, VNNI) follows the code numba generates."""
    import numba
    from llvmlite import binding

    if numba.config.CPU_FEATURES:
        return {name[1:]: name[0] == "+" for name in numba.config.CPU_FEATURES.split(",") if name[:1] in "+-"}
    return dict(binding.get_host_cpu_features())


def target_has(*names: str) -> bool:
    features = target_features()
    return all(features.get(name, False) for name in names)


@functools.cache
def use_tiles() -> bool:
    """Whether the GEMM takes blocks of 16 rows through the tile unit (``tiles.py``): the target
    has AMX-TILE and AMX-INT8 and 512-bit vectors, ``LMSERVE_TILES`` is not ``0``, and the
    kernel lets this process use the tile registers (asked here, once a process: Linux keeps
    them off until a process asks)."""
    if os.environ.get("LMSERVE_TILES", "1") == "0":
        return False
    if not target_has("avx512f", "avx512bw", "amx-tile", "amx-int8"):
        return False
    return _tile_registers_granted()


def _tile_registers_granted() -> bool:
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # asm/prctl.h
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, arch_req_xcomp_perm,
                                                         xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


_use_cache_of_these_sources()


@functools.cache
def available() -> bool:
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return target_has(*REQUIRED_FEATURES)


def start_threads() -> None:
    """Start numba's thread pool if nothing has yet. A parallel kernel that is loaded from the
    disk cache and reached only through another compiled function (``fused.dense_block`` calling
    ``matmul_int8``) does not start it, and runs into a segmentation fault (numba issue 8578);
    ``numba.get_num_threads`` starts it as a side effect."""
    import numba

    numba.get_num_threads()


def page_out_compiler() -> int:
    """Let the system take back the pages of LLVM's code (llvmlite's library) that compiling and
    loading the kernels brought in: a process that has run each kernel once (``Engine.warm_up``)
    runs compiled code only, and a compile after this reads them back from the file. Only
    read-only mappings are named, which the system drops without loss (``MADV_PAGEOUT``, Linux
    5.4 and later; elsewhere nothing happens). Returns the bytes advised."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        with open("/proc/self/maps") as fh:
            mappings = [line.split() for line in fh]
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for fields in mappings:
        if len(fields) >= 6 and "libllvmlite" in fields[5] and "w" not in fields[1]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(low, high - low, MADV_PAGEOUT) == 0:
                advised += high - low
    return advised


MADV_PAGEOUT = 21  # linux/mman.h


def set_threads(n: int | None) -> int:
    """Use n threads in the kernels (None: every core this process may use); returns n.

    BLAS (numpy's products in prefill attention) is held to one thread: its threads spin
    between calls, and on the cores the kernels' threads need, that halved prefill speed
    (measured on 2 cores)."""
    import os

    import numba
    from threadpoolctl import threadpool_limits

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, min(n or cores, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    threadpool_limits(limits=1, user_api="blas")
    return n
