"""Building a fleet's index offline (``lmserve cartridge fleet``): every chunk of every document
embedded by the served model itself, as ``worker/cartridges/fleet.py`` reads it when serving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from worker.cartridges.cartridge import model_identity
from worker.cartridges.fleet import INDEX_FILE, INDEX_FORMAT, embed, unit
from worker.engine import Engine
from worker.engine.checkpoint import write_safetensors

DOCUMENT_SUFFIXES = (".txt", ".md")


def documents_in(folder: Path) -> list[Path]:
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in DOCUMENT_SUFFIXES)
    if not found:
        raise ModelLoadError(f"{folder} holds no documents ({', '.join('*' + s for s in DOCUMENT_SUFFIXES)})")
    return found


def build_index(engine: Engine, documents: dict[str, str], out: Path, chunk_tokens: int) -> int:
    """Write the fleet's index of ``documents`` (name → text); the number of chunks."""
    vectors, owners = [], []
    for d, (name, text) in enumerate(documents.items()):
        ids = engine.tokenizer.encode(text, add_special=False, parse_special=False)
        if not ids:
            raise ModelLoadError(f"document {name} has no tokens")
        for start in range(0, len(ids), chunk_tokens):
            vectors.append(embed(engine, ids[start:start + chunk_tokens]))
            owners.append(d)
    matrix = np.stack(vectors).astype(np.float32)
    mean = matrix.mean(axis=0)
    matrix = unit(matrix - mean).astype(np.float32)
    tensors = {"embeddings": ("F32", matrix.shape, matrix.tobytes()),
               "mean": ("F32", mean.shape, mean.astype(np.float32).tobytes())}
    write_safetensors(out / INDEX_FILE, tensors, {
        "format": INDEX_FORMAT, "model": json.dumps(model_identity(engine)), "documents": json.dumps(list(documents)),
        "chunk_documents": json.dumps(owners), "chunk_tokens": str(chunk_tokens)})
    return len(owners)
