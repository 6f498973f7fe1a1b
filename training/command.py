"""``lmserve cartridge``: making cartridges and fleets offline.

    lmserve cartridge init DOC.txt --tokens P --out NAME.safetensors [--model MODEL]

writes the KV of the document's first P tokens (``worker/cartridges/cartridge.py`` says what a
cartridge is and how the worker serves one);

    lmserve cartridge train DOC… --out NAME.safetensors [--tokens P] [--model MODEL]

trains the prefix by self-study (``training/selfstudy.py`` writes the conversations,
``training/trainer.py`` optimises; needs ``lmserve[train]``), and

    lmserve cartridge fleet DOCS_DIR --out FLEET_DIR

trains one per document with an index that picks them per conversation
(``worker/cartridges/fleet.py``, ``training/fleets.py``). Torch is imported only inside the
commands that train.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from training.fleets import build_index, documents_in
from worker.cartridges.cartridge import from_document, write
from worker.engine import Engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve cartridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="a cartridge holding the KV of a document's first tokens")
    init.add_argument("document", help="a text file")
    init.add_argument("--tokens", type=int, default=256, help="positions P the cartridge holds (default 256)")
    init.add_argument("--out", required=True, help="the cartridge file to write (.safetensors)")
    init.add_argument("--model", default=None, help="GGUF file, checkpoint directory, known name or Hugging Face "
                                                    "Hub model, OWNER/REPO[:QUANT] (default: the default model)")
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
    parser.add_argument("--model", default=None, help="GGUF file, known name or Hugging Face Hub model, "
                                                      "OWNER/REPO[:QUANT] (default: the default model)")
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
        from training.trainer import TrainSettings
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
    from training.trainer import Trainer

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


def fleet_command(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str) -> int:
    """``lmserve cartridge fleet``: a cartridge per document, then the index."""
    folder = Path(args.docs_dir)
    if not folder.is_dir():
        parser.error(f"no such directory: {folder}")
    try:
        from training.trainer import Trainer
    except ImportError as exc:
        parser.error(str(exc))
    settings = train_settings(parser, args)
    try:
        paths = documents_in(folder)
    except ModelLoadError as exc:
        parser.error(exc.message)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(model, kv_type="f32")
    documents = {p.stem: p.read_text(encoding="utf-8") for p in paths}
    for i, (name, text) in enumerate(documents.items()):
        target = out / f"{name}.safetensors"
        if target.is_file() and not args.fresh:
            print(f"[{i + 1}/{len(documents)}] {name}: kept {target}")
            continue
        print(f"[{i + 1}/{len(documents)}] {name}")
        trainer = Trainer(engine, text, settings, out / f"{name}.safetensors.ckpt", fresh=args.fresh)
        trainer.write_samples()
        trainer.train()
        trainer.write(target, f"self-study on {name}")
    chunks = build_index(engine, documents, out, args.index_chunk_tokens)
    print(f"{out}: {len(documents)} cartridges of {engine.model_id}, an index of {chunks} chunks")
    return 0
