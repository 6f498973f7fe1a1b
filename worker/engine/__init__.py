"""The inference engine: a GGUF model read in place, its kernels and its KV caches.

``Engine`` (``loaded.py``) is what the worker holds: the model with its tokenizer and template.
It is imported on first use, so a process that only reads a file's header or its vocabulary
(``gguf_file``; a benchmark preparing prompts) does not load numba and LLVM: a process that has
mapped LLVM's library keeps those pages resident in a worker beside it too, where the worker
would have given them back after its warm-up (``kernels.page_out_compiler``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.loaded import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from worker.engine.loaded import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
