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

writes the KV of the document's first P tokens: already a way to serve a document's prefix
without sending it, and where a trained cartridge starts:

    lmserve cartridge train DOC… --out NAME.safetensors [--tokens P] [--model MODEL]

trains the prefix by self-study (``training/trainer.py``; needs ``lmserve[train]``), and

    lmserve cartridge fleet DOCS_DIR --out FLEET_DIR

trains one per document with an index that picks them per conversation (``worker/cartridges/fleet.py``).
The commands are ``training/command.py``; this module is what serving reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from shared.gguf_names import split_part, split_part_paths
from worker.engine import Engine, ops
from worker.engine.checkpoint import SafetensorsFile, floats, write_safetensors
from worker.engine.kv_cache import KVCache

FORMAT = "lmserve-cartridge-1"
PSEUDO_BITS = 15  # a cartridge's positions in its pseudo-ids: fewer than 2**15 (int32 ids, spilled keys)


KEY_LAYOUT = "rope-v2"  # how the engine lays keys out (as its KV fingerprint says): part of a match


def model_identity(engine: Engine) -> dict[str, object]:
    """What a cartridge must match: the family, the KV geometry, and the weights (their file's
    size and a digest of its first and last MiB, as the engine's KV fingerprint reads them; for a
    split model, then each later part's)."""
    path = Path(engine.model.path)
    weights = path / "model.safetensors" if path.is_dir() else path
    split = split_part(str(weights))
    parts = [Path(p) for p in split_part_paths(str(weights), split[2])] if split else [weights]
    digest = hashlib.sha256(f"{weights.stat().st_size}:{KEY_LAYOUT}".encode())
    for n, part in enumerate(parts):
        size = part.stat().st_size
        if n:
            digest.update(f":{size}".encode())
        with open(part, "rb") as fh:
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
    # The ids that stand for the prefix in a cache's token list (never fed to the model):
    # negative, and each cartridge's own (from its id), so a cache held under one cartridge is
    # never reused under another. A composition holds its parts' in turn.
    pseudo_ids: list[int] = field(default_factory=list)
    parts: tuple[str, ...] = ()  # a composition's parts' names, in order

    def __post_init__(self) -> None:
        if not self.pseudo_ids:
            base = int(self.cartridge_id.rsplit(":", 1)[-1][:4], 16) << PSEUDO_BITS
            self.pseudo_ids = [-(base | (i + 1)) for i in range(self.tokens)]

    @property
    def names(self) -> list[str]:
        """What a reply says served it: the parts of a composition, else the name."""
        return list(self.parts) or [self.name]

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
            raise ModelLoadError(f"{path}: this model keeps recurrent state beside its KV (linear attention or short convolutions), "
                                 f"which a cartridge does not hold; it cannot serve one")
        if engine.model.diffusion:
            raise ModelLoadError(f"{path}: this model writes its replies a block at a time (text diffusion), "
                                 f"which a cartridge was not trained for; it cannot serve one")
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
                held = floats(dtype, raw, shape)
                # a NaN in a prefix reaches every reply's attention, which then samples nothing
                with np.errstate(over="ignore", invalid="ignore"):
                    finite = np.isfinite(held.astype(cache.dtype)).all()
                if not finite:
                    raise ModelLoadError(f"{path}: {name}.{layer} holds NaN or infinite values (or values beyond "
                                         f"the KV cache's {cache.dtype.name}): a cartridge must hold finite ones")
                out.append(held)
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

    def under(self, cache: KVCache, cached: int) -> int:
        """Put the prefix into a cache that holds ``cached`` tokens of a conversation served
        behind it, unless it holds it already; the tokens it then holds."""
        if cached < self.tokens:
            self.put_into(cache)
            return self.tokens
        return cached


def kv_layer_owners(engine: Engine) -> list[int]:
    """For each layer of a cache, the model layer that keeps it (layers that read another's KV,
    or hold recurrent state, keep none)."""
    hp = engine.model.hp
    if not hp.layers:
        return list(range(hp.n_layer))
    return [i for i, shape in enumerate(hp.layers) if shape.kv_from is None and not shape.recurrent]


def compose(parts: list[Cartridge], engine: Engine) -> Cartridge:
    """Several cartridges as one prefix, in the order given. Each part was trained at positions
    0..P−1; its keys are turned by RoPE to the positions it takes here (after the parts before
    it), so every part keeps the distances to the conversation it was trained with."""
    if len(parts) == 1:
        return parts[0]
    model = engine.model
    total = sum(part.tokens for part in parts)
    cache = engine.new_cache(total)
    offset = 0
    for part in parts:
        scratch = engine.new_cache(part.tokens)
        part.put_into(scratch)
        for layer, owner in enumerate(kv_layer_owners(engine) if offset else []):
            inv_freq, adjacent = model.rope_tables[model.layer_rope[owner]]
            cos, sin = ops.rope_cos_sin(np.full(part.tokens, offset), inv_freq)
            held = scratch.key_rows(layer, 0, part.tokens)
            scratch.put_key_rows(layer, 0, ops.apply_rope(held.transpose(1, 0, 2), cos, sin, adjacent).transpose(1, 0, 2))
        keys, values = scratch.export(0, part.tokens)
        cache.restore(offset, keys, values, part.pseudo_ids)
        offset += part.tokens
    keys, values = cache.export(0, total)
    return Cartridge("+".join(p.cartridge_id for p in parts), "+".join(p.name for p in parts), total, keys, values,
                     [t for p in parts for t in p.pseudo_ids], tuple(n for p in parts for n in p.names))


def write(path: str | os.PathLike, engine: Engine, cache: KVCache, tokens: int, source: str) -> None:
    """Save positions 0..tokens−1 of a cache as a cartridge of this engine's model."""
    write_arrays(path, engine, [cache.key_rows(i, 0, tokens) for i in range(cache.n_layer)],
                 [cache.values[i][:, :tokens] for i in range(cache.n_layer)], tokens, source)


def write_arrays(path: str | os.PathLike, engine: Engine, keys: list[np.ndarray], values: list[np.ndarray],
                 tokens: int, source: str, training: dict | None = None) -> None:
    """Save per-layer keys and values [KV heads, tokens, size] as a cartridge of this engine's
    model; ``training`` says how they were trained (None: not trained)."""
    tensors = {}
    for layer, pair in enumerate(zip(keys, values)):
        for name, held in zip(("keys", "values"), pair):
            array = np.ascontiguousarray(held, dtype=np.float16)
            tensors[f"{name}.{layer}"] = ("F16", array.shape, array.tobytes())
    meta = {"format": FORMAT, "model": json.dumps(model_identity(engine)), "tokens": str(tokens), "source": source}
    if training is not None:
        meta["training"] = json.dumps(training)
    write_safetensors(path, tensors, meta)


def from_document(engine: Engine, text: str, tokens: int) -> tuple[KVCache, int]:
    """The KV of a document's first ``tokens`` tokens (fewer where it is shorter)."""
    ids = engine.tokenizer.encode(text, parse_special=False)[:tokens]
    if not ids:
        raise ModelLoadError("the document has no tokens")
    cache = engine.new_cache(len(ids))
    engine.prefill(cache, ids)
    return cache, len(ids)
