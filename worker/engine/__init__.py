"""The inference engine: a GGUF model read in place, its kernels and its KV caches.

``Engine`` (``loaded.py``) is what the worker holds: the model with its tokenizer and template.
"""

from worker.engine.loaded import Engine

__all__ = ["Engine"]
