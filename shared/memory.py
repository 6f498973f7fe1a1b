"""How a process of ours asks the C allocator for memory.

glibc serves a request below its mmap threshold from the heap, and that threshold rises by
itself (up to 32 MiB) each time a larger mapped block is freed. Large blocks that come and go
then leave holes in the heap that later small allocations pin, and the process keeps them:
when KV caches were still allocated through it, serving a 2k and a 6.5k prompt cost the worker
230 MiB more than its caches held. KV caches now map their own memory (``kv_cache.mapped_block``);
fixing the threshold does the same for every other large block (a weight being dequantized, a
verify pass's logits), while the step-sized temporaries of a forward pass, all below it, are
still reused from the heap. (Spilled chunks' copies are mapped too; the spiller keeps one such
buffer for the next chunk rather than pay a fresh mapping's page faults for each.) A gateway fixes it too: a large request body,
its parsed JSON and its rendered prompt are blocks of megabytes that come and go.

Loading frees far more than it keeps (the file's vocabulary read and rebuilt, weights repacked,
kernels loaded), and the allocator keeps freed blocks inside its heap for reuse:
``give_back_freed_memory`` (glibc's ``malloc_trim``) returns every whole free page of it once
a process has loaded (about 10 MiB of a worker serving gemma-3-270m), and a worker calls it
again each time its scheduler runs out of work (in-process, 11 MiB of gemma-3-270m's heap
after a third 2,400-token prompt).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("lmserve.memory")

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 4 << 20  # above a prefill chunk's temporaries (256 rows x 1,536 floats: 1.5 MiB)


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Blocks of ``threshold`` bytes and more are mapped apart from the heap from now on.
    Returns False where the C library is not glibc (the call is then a no-op)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        log.info("the C library has no mallopt: large blocks are left to its own policy")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def give_back_freed_memory() -> bool:
    """Return the heap's whole free pages to the system; False where the C library cannot."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
