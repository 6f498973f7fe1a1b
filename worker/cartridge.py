"""Cartridges: a KV prefix served before every conversation (``--cartridge FILE``).

A cartridge holds, for every layer, the keys (after RoPE, at positions 0..P−1) and values of P
positions. The worker puts them at the head of each conversation's cache, so the conversation's
own tokens take positions P onwards and attend to the prefix as if a document had been read
there. In a cache the prefix stands as P pseudo-tokens (ids −1…−P, never fed to the model), so
prefix reuse across requests works unchanged, and the kvstore's chunk keys carry the
cartridge's id (a conversation cached under one cartridge is never restored under another).

The file is safetensors: ``keys.N`` and ``values.N`` as [KV heads, P, head size] in f16, and
metadata naming the model (architecture, KV geometry, weights file size), P and the source.

    lmserve cartridge init DOC.txt --tokens P --out NAME.safetensors [--model MODEL]

writes the KV of the document's first P tokens: the starting point of a trained cartridge
(training is not built yet), and already a way to serve a document's prefix without sending it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import Engine
from worker.engine.checkpoint import SafetensorsFile, floats, write_safetensors
from worker.engine.kv_cache import KVCache

FORMAT = "lmserve-cartridge-1"
PSEUDO_BITS = 15  # a cartridge's positions in its pseudo-ids: fewer than 2**15 (int32 ids, spilled keys)


KEY_LAYOUT = "rope-v2"  # how the engine lays keys out (as its KV fingerprint says): part of a match


def model_identity(engine: Engine) -> dict[str, object]:
    """What a cartridge must match: the family, the KV geometry, and the weights (their file's
    size and a digest of its first and last MiB, as the engine's KV fingerprint reads them)."""
    path = Path(engine.model.path)
    weights = path / "model.safetensors" if path.is_dir() else path
    size = weights.stat().st_size
    digest = hashlib.sha256(f"{size}:{KEY_LAYOUT}".encode())
    with open(weights, "rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        digest.update(fh.read(1 << 20))
    return {"architecture": engine.architecture,
            "geometry": [list(g) for g in engine.new_cache(1).geometry],
            "weights": digest.hexdigest()[:32]}


@dataclass
class Cartridge:
    cartridge_id: str  # the file's content hash: what the kvstore's chunk keys carry
    name: str
    tokens: int  # P
    keys: np.ndarray  # in the shape KVCache.restore takes for P positions
    values: np.ndarray

    @property
    def pseudo_ids(self) -> list[int]:
        """The ids that stand for the prefix in a cache's token list (never fed to the model):
        negative, and each cartridge's own (from its id), so a cache held under one cartridge
        is never reused under another."""
        base = int(self.cartridge_id.rsplit(":", 1)[-1][:4], 16) << PSEUDO_BITS
        return [-(base | (i + 1)) for i in range(self.tokens)]

    @classmethod
    def load(cls, path: str | os.PathLike, engine: Engine) -> Cartridge:
        """Read a cartridge for this engine; ModelLoadError naming what does not match."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"cartridge not found: {path}")
        file = SafetensorsFile(path)
        meta = file.metadata
        if meta.get("format") != FORMAT:
            raise ModelLoadError(f"{path} is not an lmserve cartridge (no format {FORMAT!r} in its metadata)")
        try:
            made_for = json.loads(meta["model"])
            tokens = int(meta["tokens"])
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{path}: its metadata is incomplete ({exc})") from exc
        if not 0 < tokens < 1 << PSEUDO_BITS:
            raise ModelLoadError(f"{path} holds {tokens} positions; a cartridge holds 1 to {(1 << PSEUDO_BITS) - 1}")
        here = model_identity(engine)
        if not engine.new_cache(1).rewindable:
            raise ModelLoadError(f"{path}: this model keeps recurrent state beside its KV (linear attention), "
                                 f"which a cartridge does not hold; it cannot serve one")
        if engine.model.reads_cache_tokens:
            raise ModelLoadError(f"{path}: this model reads the tokens its cache holds (nanochat's smear reads the "
                                 f"previous token), which a cartridge's positions have not; it cannot serve one")
        for key, what in (("architecture", "a model of family"), ("geometry", "a model with the KV geometry"),
                          ("weights", "the weights whose digest is")):
            if made_for.get(key) != here[key]:
                raise ModelLoadError(f"{path} was made for {what} {made_for.get(key)}, and this model's is "
                                     f"{here[key]}: a cartridge serves only the model it was made from")
        cache = engine.new_cache(tokens)
        keys, values = [], []
        for layer, (n_kv, d, dv) in enumerate(cache.geometry):
            for name, width, out in (("keys", d, keys), ("values", dv, values)):
                if f"{name}.{layer}" not in file.entries:
                    raise ModelLoadError(f"{path} lacks {name}.{layer}")
                dtype, shape, raw = file.raw(f"{name}.{layer}")
                if shape != (n_kv, tokens, width):
                    raise ModelLoadError(f"{path}: {name}.{layer} is {list(shape)}, not [{n_kv}, {tokens}, {width}]")
                out.append(floats(dtype, raw, shape))
        if cache.uniform:
            stacked_keys, stacked_values = np.stack(keys), np.stack(values)
        else:
            stacked_keys = np.concatenate([k.ravel() for k in keys])
            stacked_values = np.concatenate([v.ravel() for v in values])
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        digest = digest.hexdigest()[:16]
        return cls(f"cartridge:{digest}", path.stem, tokens, stacked_keys.astype(cache.dtype),
                   stacked_values.astype(cache.dtype))

    def put_into(self, cache: KVCache) -> None:
        """Make the cache hold the prefix and nothing after it."""
        cache.truncate(0)
        cache.restore(0, self.keys, self.values, self.pseudo_ids)


def write(path: str | os.PathLike, engine: Engine, cache: KVCache, tokens: int, source: str) -> None:
    """Save positions 0..tokens−1 of a cache as a cartridge of this engine's model."""
    tensors = {}
    for layer in range(cache.n_layer):
        for name, held in (("keys", cache.keys[layer]), ("values", cache.values[layer])):
            array = np.ascontiguousarray(held[:, :tokens], dtype=np.float16)
            tensors[f"{name}.{layer}"] = ("F16", array.shape, array.tobytes())
    write_safetensors(path, tensors, {"format": FORMAT, "model": json.dumps(model_identity(engine)),
                                      "tokens": str(tokens), "source": source})


def from_document(engine: Engine, text: str, tokens: int) -> tuple[KVCache, int]:
    """The KV of a document's first ``tokens`` tokens (fewer where it is shorter)."""
    ids = engine.tokenizer.encode(text, parse_special=False)[:tokens]
    if not ids:
        raise ModelLoadError("the document has no tokens")
    cache = engine.new_cache(len(ids))
    engine.prefill(cache, ids)
    return cache, len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve cartridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="a cartridge holding the KV of a document's first tokens")
    init.add_argument("document", help="a text file")
    init.add_argument("--tokens", type=int, default=256, help="positions P the cartridge holds (default 256)")
    init.add_argument("--out", required=True, help="the cartridge file to write (.safetensors)")
    init.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: the default model)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    from shared.default_model import resolve_model

    engine = Engine.load(resolve_model(args.model))
    cache, tokens = from_document(engine, Path(args.document).read_text(encoding="utf-8"), args.tokens)
    write(args.out, engine, cache, tokens, f"document prefix of {Path(args.document).name} (untrained)")
    print(f"{args.out}: {tokens} positions of {engine.model_id} ({cache.bytes_per_token * tokens / 2**20:.1f} MiB of KV)")
    return 0
