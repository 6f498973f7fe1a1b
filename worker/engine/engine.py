"""The engine: a loaded model with its tokenizer and template, and single-stream generation.

The worker's scheduler drives ``model.forward`` directly to batch streams; this module gives
it the pieces (prefill in chunks, sampling, stop checks) and gives ``lmserve generate`` and the
benchmarks a simple generate loop.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from shared.chat_template import ChatTemplate
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from worker.engine.archs import load_model
from worker.engine.gguf_file import GGUFFile
from worker.engine.kv_cache import KVCache
from worker.engine.model import DecoderModel
from worker.engine.sampling import SampledToken, Sampler

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first completion token comes out of the prefill pass
        steps = max(self.completion_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class Engine:
    model: DecoderModel
    tokenizer: Tokenizer
    template: ChatTemplate | None
    model_id: str
    fingerprint: str  # identifies weights + KV geometry: cached KV is only valid for the same
    metadata: dict = field(repr=False, default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike, on_progress: Callable[[int, int], None] | None = None,
             exact: bool = False, kv_type: str = "f16") -> "Engine":
        """on_progress(bytes taken, bytes in all tensors) is called as the weights are mapped.
        ``exact`` holds every weight as float32 (see ``DecoderModel``); ``kv_type`` is the KV
        cache's storage, ``f16`` or ``f32``."""
        gguf = GGUFFile(path, on_progress)
        model = load_model(gguf, exact, kv_type)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        source = gguf.metadata.get("tokenizer.chat_template")
        template = None
        if isinstance(source, str) and source.strip():
            template = ChatTemplate(source, bos_token=tokenizer.id_to_piece(tokenizer.bos_id)
                                    if tokenizer.bos_id is not None else "",
                                    eos_token=tokenizer.id_to_piece(tokenizer.eos_id)
                                    if tokenizer.eos_id is not None else "")
        name = os.path.splitext(os.path.basename(gguf.path))[0]
        return cls(model, tokenizer, template, name, _fingerprint(gguf, model), gguf.metadata)

    @property
    def architecture(self) -> str:
        return self.model.architecture

    def new_cache(self, max_tokens: int) -> KVCache:
        return self.model.new_cache(max_tokens)

    def prefill(self, cache: KVCache, tokens: list[int], chunk: int = DEFAULT_PREFILL_CHUNK) -> np.ndarray:
        """Feed tokens in chunks (bounded memory for attention scores); logits of the last one."""
        logits = None
        for start in range(0, len(tokens), chunk):
            logits = self.model.forward([(cache, tokens[start:start + chunk])])[0]
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits

    def generate(self, prompt: list[int], params: SamplingParams, max_tokens: int,
                 stop_ids: set[int] | None = None, cache: KVCache | None = None,
                 stats: GenerationStats | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Iterator[SampledToken]:
        """Yield sampled tokens one by one until a stop token, max_tokens or the context ends.

        A stop token is yielded (so callers can report it) and ends the stream. With a cache that
        already holds a prefix of ``prompt``, only the rest is computed.
        """
        stats = stats if stats is not None else GenerationStats()
        stop_ids = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        budget = min(self.model.hp.context_length, len(prompt) + max_tokens)
        if cache is None:
            cache = self.new_cache(budget)
        reused = cache.common_prefix(prompt)
        if reused == len(prompt):  # recompute the last token: its logits are not kept
            reused -= 1
        cache.truncate(reused)
        stats.prompt_tokens, stats.cached_tokens = len(prompt), reused
        sampler = Sampler(params, prompt)
        started = time.perf_counter()
        logits = self.prefill(cache, prompt[reused:])
        stats.prefill_seconds = time.perf_counter() - started
        started = time.perf_counter()
        while True:
            token = sampler.sample(logits)
            stats.completion_tokens += 1
            yield token
            if token.token_id in stop_ids:
                stats.finish_reason = "stop"
                break
            if stats.completion_tokens >= max_tokens:
                stats.finish_reason = "length"
                break
            if cache.length >= cache.max_tokens:
                stats.finish_reason = "context"
                break
            if should_stop is not None and should_stop():
                stats.finish_reason = "abort"
                break
            logits = self.model.forward([(cache, [token.token_id])])[0]
        stats.decode_seconds = time.perf_counter() - started


def _fingerprint(gguf: GGUFFile, model: DecoderModel) -> str:
    """Hash of the file's identity and the KV geometry and storage type; cheap (no full read of
    the weights). ``rope-v2``: llama keys are kept in the file's adjacent-pair order."""
    hp = model.hp
    digest = hashlib.sha256()
    stat = os.stat(gguf.path)
    digest.update(f"{stat.st_size}".encode())  # content, not the path: copies share cached KV
    with open(gguf.path, "rb") as fh:  # head and tail of the file stand in for its content
        digest.update(fh.read(1 << 20))
        fh.seek(max(0, stat.st_size - (1 << 20)))
        digest.update(fh.read(1 << 20))
    digest.update(f"{model.architecture}:{hp.n_layer}:{hp.n_head_kv}:{hp.head_dim}:{hp.value_dim}:"
                  f"{model.kv_type}:rope-v2".encode())
    return digest.hexdigest()[:32]
