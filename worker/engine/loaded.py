"""The engine: a loaded model with its tokenizer and metadata, and the identity of its KV.

The worker's scheduler drives ``model.forward`` to batch streams (the one decode loop, also
behind ``lmserve generate``); ``prefill`` feeds a prompt in chunks for the benchmarks and tests.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shared.gguf_names import model_name
from shared.tokenizer import Tokenizer
from worker.engine import kernels
from worker.engine.archs import load_model
from worker.engine.checkpoint import NanochatCheckpoint
from worker.engine.compile_ahead import CompileAhead, mark_done, pending, steps_job
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels import fused
from worker.engine.kv_cache import KVCache
from worker.engine.model import DecoderModel

DEFAULT_PREFILL_CHUNK = 512

# vocabulary arrays the tokenizer keeps in its own form (scores as float32 bytes, types as
# bytes): the metadata's lists of Python numbers are 12 MiB for a 262k vocabulary
# the vocabulary lives on in the tokenizer alone (a 262k-token file's strings are some 30 MB)
_KEPT_BY_TOKENIZER = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                      "tokenizer.ggml.merges")


@dataclass
class Engine:
    model: DecoderModel
    tokenizer: Tokenizer
    model_id: str
    fingerprint: str  # identifies weights + KV geometry: cached KV is only valid for the same
    metadata: dict = field(repr=False, default_factory=dict)
    compiling: CompileAhead | None = field(repr=False, default=None)  # helpers of a first start
    # a first start's compile of the one-call blocks after the warm-up (``warm_up``'s ``later``)
    compiling_later: threading.Thread | None = field(repr=False, default=None)

    @classmethod
    def load(cls, path: str | os.PathLike, on_progress: Callable[[int, int], None] | None = None,
             exact: bool = False, kv_type: str = "f16") -> "Engine":
        """on_progress(bytes taken, bytes in all tensors) is called as the weights are mapped.
        ``exact`` holds every weight as float32 (see ``DecoderModel``); ``kv_type`` is the KV
        cache's storage, ``f16`` or ``f32``."""
        # a directory is a nanochat checkpoint; anything else a GGUF file
        gguf = NanochatCheckpoint(path, on_progress) if os.path.isdir(path) else GGUFFile(path, on_progress)
        # the kernels a first start on this CPU lacks compile in other processes while it loads
        ahead = CompileAhead.start(gguf.matrix_weights(), gguf.head_type(), kv_type) if kernels.available() and not exact else None
        model = load_model(gguf, exact, kv_type)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        for key in _KEPT_BY_TOKENIZER:
            gguf.metadata.pop(key, None)
        name = os.path.basename(os.path.normpath(gguf.path)) if os.path.isdir(gguf.path) \
            else model_name(gguf.path)
        engine = cls(model, tokenizer, name, _fingerprint(gguf, model), gguf.metadata)
        engine.compiling = ahead
        return engine

    @property
    def architecture(self) -> str:
        return self.model.architecture

    def new_cache(self, max_tokens: int) -> KVCache:
        return self.model.new_cache(max_tokens)

    def _pending_steps(self) -> list[str]:
        """The block steps' job where a first start may lack it and it is not yet marked."""
        if self.compiling is None:
            return []
        job = steps_job(self.architecture, self.model.held_weights(), self.model.kv_type)
        return [job] if pending(job) else []

    def warm_up(self, on_compile: Callable[[list[str]], None] | None = None,
                later: Callable[[float], None] | None = None) -> None:
        """Run each path of a forward pass once on scratch caches: a chunk of one sequence, a
        batch of two, one token alone. numba compiles a kernel on its first call (on a first
        start on a CPU that takes a minute or more; later starts load it from the disk cache),
        so without this the first requests would wait for it, holding the engine. On a first
        start the leaf kernels compile in other processes meanwhile (``compile_ahead``): this
        waits for them first (``on_compile`` hears what they compile).

        The passes run on a thread of their own that ends with them. OpenMP (numba's threading
        layer) keeps a team of threads for each thread that ran a parallel kernel; a team left
        on the caller would count against the cores while another thread (the worker's engine
        thread) runs the kernels, and libgomp then puts idle threads to sleep between parallel
        regions instead of spinning: a served decode step took three times as long.

        With ``later``, a first start of these block steps leaves one of them to a thread that
        compiles it after this returns: the one call that takes one sequence's whole dense block
        (``fused.dense_block``), a few seconds of a first start that only saves a decode step the
        Python between four calls a layer. The four calls serve meanwhile, with the same numbers;
        the thread then switches to the one and calls ``later`` with the seconds it took."""
        ahead = self.compiling if self.compiling is not None and self.compiling.jobs else None
        steps = self._pending_steps()
        if (ahead is not None or steps) and on_compile is not None:
            on_compile((ahead.jobs if ahead is not None else []) + steps)
        self.compiling = None
        failure: list[BaseException] = []
        deferred = self.model.one_call_signatures() if steps and later is not None else set()
        self.model.one_call_blocks = not deferred

        def run() -> None:
            try:
                if ahead is not None:
                    # the steps around attention compile here while its kernel compiles there
                    ahead.wait_for_matrices()
                    self.model.warm_products()
                    ahead.wait()
                first, second = self.new_cache(8), self.new_cache(8)
                self.model.forward([(first, [0, 1, 2])])
                self.model.forward([(first, [3]), (second, [0, 1])])
                self.model.forward([(second, [2])])
            except BaseException as exc:  # raised again on the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=run, name="warm-up")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
        if deferred:
            self.compiling_later = threading.Thread(target=self._compile_later, args=(deferred, steps, later),
                                                    name="one-call blocks", daemon=True)
            self.compiling_later.start()
            return
        for job in steps:
            mark_done(job)
        kernels.page_out_compiler()

    def _compile_later(self, signatures: set[tuple], steps: list[str], later: Callable[[float], None]) -> None:
        """Compile the one-call blocks without running them, then take them; the steps' job is
        marked only then, so a start that stops before compiles them again."""
        started = time.perf_counter()
        for signature in signatures:
            fused.dense_block.compile(signature)
        self.model.one_call_blocks = True
        for job in steps:
            mark_done(job)
        kernels.page_out_compiler()
        later(time.perf_counter() - started)

    def prefill(self, cache: KVCache, tokens: list[int], chunk: int = DEFAULT_PREFILL_CHUNK) -> np.ndarray:
        """Feed tokens in chunks (bounded memory for attention scores); logits of the last one."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        cache.prompt_end = cache.length + len(tokens)
        cache.reserve(len(tokens))  # grown once, not chunk by chunk (each growth copies what it holds)
        for start in range(0, len(tokens), chunk):
            last = start + chunk >= len(tokens)
            logits = self.model.forward([(cache, tokens[start:start + chunk])], tails=[1 if last else 0])[0]
        return logits


def _fingerprint(gguf: GGUFFile | NanochatCheckpoint, model: DecoderModel) -> str:
    """Hash of the file's identity and the KV geometry and storage type; cheap (no full read of
    the weights). ``rope-v2``: llama keys are kept in the file's adjacent-pair order."""
    hp = model.hp
    digest = hashlib.sha256()
    paths = [gguf.file.path] if isinstance(gguf, NanochatCheckpoint) else gguf.paths  # every part of a split
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{stat.st_size}".encode())  # content, not the path: copies share cached KV
        with open(path, "rb") as fh:  # head and tail of the file stand in for its content
            digest.update(fh.read(1 << 20))
            fh.seek(max(0, stat.st_size - (1 << 20)))
            digest.update(fh.read(1 << 20))
    digest.update(f"{model.architecture}:{hp.n_layer}:{hp.n_head_kv}:{hp.head_dim}:{hp.value_dim}:"
                  f"{model.kv_type}:rope-v2".encode())
    if hp.layers:  # layers of their own shapes (gemma4)
        digest.update(repr(hp.layers).encode())
    if isinstance(gguf, NanochatCheckpoint):  # its shape and RoPE come from files beside the weights
        digest.update(repr(sorted((k, v) for k, v in gguf.metadata.items() if k.startswith("nanochat."))).encode())
    return digest.hexdigest()[:32]
