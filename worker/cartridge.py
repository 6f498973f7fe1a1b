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

trains the prefix by self-study (``worker/cartridge_train.py``; needs ``lmserve[train]``), and

    lmserve cartridge fleet DOCS_DIR --out FLEET_DIR

trains one per document with an index that picks them per conversation (``worker/fleet.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import Engine, ops
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
            held = scratch.keys[layer][:, :part.tokens]
            held[...] = ops.apply_rope(held.transpose(1, 0, 2), cos, sin, adjacent).transpose(1, 0, 2)
        keys, values = scratch.export(0, part.tokens)
        cache.restore(offset, keys, values, part.pseudo_ids)
        offset += part.tokens
    keys, values = cache.export(0, total)
    return Cartridge("+".join(p.cartridge_id for p in parts), "+".join(p.name for p in parts), total, keys, values,
                     [t for p in parts for t in p.pseudo_ids], tuple(n for p in parts for n in p.names))


def write(path: str | os.PathLike, engine: Engine, cache: KVCache, tokens: int, source: str) -> None:
    """Save positions 0..tokens−1 of a cache as a cartridge of this engine's model."""
    write_arrays(path, engine, [cache.keys[i][:, :tokens] for i in range(cache.n_layer)],
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve cartridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="a cartridge holding the KV of a document's first tokens")
    init.add_argument("document", help="a text file")
    init.add_argument("--tokens", type=int, default=256, help="positions P the cartridge holds (default 256)")
    init.add_argument("--out", required=True, help="the cartridge file to write (.safetensors)")
    init.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: the default model)")
    train = sub.add_parser("train", help="train a cartridge on documents by self-study (needs lmserve[train])",
                           description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("documents", nargs="+", help="text files: one cartridge learns them all")
    train.add_argument("--out", required=True, help="the cartridge file to write (.safetensors); the checkpoint "
                                                    "is kept beside it as OUT.ckpt")
    add_training_flags(train)
    fleet = sub.add_parser("fleet", help="train a cartridge per document and their index, for --fleet",
                           description=FLEET_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet.add_argument("docs_dir", help="a directory of documents (*.txt, *.md), one cartridge each")
    fleet.add_argument("--out", required=True, help="the fleet directory to write")
    fleet.add_argument("--index-chunk-tokens", type=int, default=128,
                       help="document tokens per indexed chunk (default 128)")
    add_training_flags(fleet)
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    from shared.default_model import resolve_model

    if args.command == "train":
        return train_command(parser, args, resolve_model(args.model))
    if args.command == "fleet":
        from worker.fleet import fleet_command

        if args.index_chunk_tokens < 1:
            parser.error("--index-chunk-tokens must be at least 1")
        return fleet_command(parser, args, resolve_model(args.model))
    engine = Engine.load(resolve_model(args.model))
    cache, tokens = from_document(engine, Path(args.document).read_text(encoding="utf-8"), args.tokens)
    write(args.out, engine, cache, tokens, f"document prefix of {Path(args.document).name} (untrained)")
    print(f"{args.out}: {tokens} positions of {engine.model_id} ({cache.bytes_per_token * tokens / 2**20:.1f} MiB of KV)")
    return 0


TRAIN_HELP = """The engine writes conversations about the documents' chunks with each chunk in front of it
and records its own top-k log-probabilities (self-study); then a KV prefix of --tokens positions,
started from the KV of the documents' first tokens, learns to give the same distributions with the
documents absent. Running the same command again resumes from OUT.ckpt."""


FLEET_HELP = """Trains a cartridge for every document as 'lmserve cartridge train' does (one checkpoint
each; a finished cartridge is kept, so an interrupted run goes on where it stopped), then indexes
every chunk of every document with the served model's pooled hidden states. Serve it with
'lmserve worker --fleet FLEET_DIR'."""


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=256, help="positions P a cartridge holds (default 256)")
    parser.add_argument("--samples", type=int, default=64, help="self-study conversations to write (default 64)")
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps (default 200)")
    parser.add_argument("--batch", type=int, default=4, help="conversations per step (default 4)")
    parser.add_argument("--lr", type=float, default=2e-2, help="Adam's learning rate (default 0.02)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="document tokens in front of each "
                                                                      "self-study conversation (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="ignore checkpoints left by an earlier run")


def train_settings(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The training flags, checked, as TrainSettings (torch is imported here)."""
    try:
        from worker.cartridge_train import TrainSettings
    except ImportError as exc:
        parser.error(str(exc))
    for name in ("samples", "steps", "batch", "chunk_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.lr > 0:
        parser.error("--lr must be above 0")
    return TrainSettings(tokens=args.tokens, samples=args.samples, steps=args.steps, batch=args.batch,
                         lr=args.lr, chunk_tokens=args.chunk_tokens, seed=args.seed)


def train_command(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str) -> int:
    settings = train_settings(parser, args)
    from worker.cartridge_train import Trainer

    texts = []
    for document in args.documents:
        if not Path(document).is_file():
            parser.error(f"no such document: {document}")
        texts.append(Path(document).read_text(encoding="utf-8"))
    engine = Engine.load(model, kv_type="f32")
    out = Path(args.out)
    trainer = Trainer(engine, "\n\n".join(texts), settings, out.with_name(out.name + ".ckpt"), fresh=args.fresh)
    trainer.write_samples()
    losses = trainer.train()
    names = ", ".join(Path(d).name for d in args.documents)
    trainer.write(out, f"self-study on {names}")
    tenth = max(1, len(losses) // 10)
    first, last = np.mean(losses[:tenth]), np.mean(losses[-tenth:])
    print(f"{out}: {trainer.tokens} positions of {engine.model_id}, trained {trainer.step} steps on "
          f"{len(trainer.samples)} conversations; loss {first:.4f} -> {last:.4f}")
    return 0
