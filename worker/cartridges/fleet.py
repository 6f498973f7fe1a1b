"""A fleet: one cartridge per document and an index that picks them per conversation (``--fleet DIR``).

    lmserve cartridge fleet DOCS_DIR --out FLEET_DIR [training flags]

trains a cartridge for every ``*.txt`` and ``*.md`` in DOCS_DIR (``FLEET_DIR/NAME.safetensors``,
resumable: a finished one is kept) and writes ``FLEET_DIR/index.safetensors``: an embedding of
every chunk of every document, made by the served model itself (the mean of its final normed
hidden states over the chunk, centred on the mean of all chunks and scaled to unit length).

Serving, each conversation's last user message is embedded the same way; the ``--rag-chunks``
chunks nearest to it by cosine similarity are scanned, a document scores its best chunk among
them, and the ``--rag-docs`` best documents' cartridges compose as the conversation's prefix
(best first). The choice is kept per conversation (in the kvstore when there is one, so every
worker sees it): later turns keep it, unless ``--rag-adaptive`` is on and a document outside it
out-scores the weakest chosen one by ``--rag-margin``. The index goes into the kvstore too, keyed
by the fleet's cartridges, so a worker given the cartridges alone reads it from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ModelLoadError
from worker import metrics
from worker.cartridges.cartridge import Cartridge, model_identity
from worker.engine import Engine
from worker.engine.checkpoint import SafetensorsFile, floats

INDEX_FORMAT = "lmserve-fleet-1"
INDEX_FILE = "index.safetensors"
MAX_LOCAL_CHOICES = 4096  # conversations whose choice is kept in memory when there is no kvstore


def embed(engine: Engine, ids: list[int], window: int = 512) -> np.ndarray:
    """The mean of the final normed hidden states over ``ids`` (their last ``window`` tokens)."""
    ids = ids[-window:]
    cache = engine.new_cache(len(ids))
    return engine.model.forward([(cache, ids)], all_logits=True, hidden=True)[0].mean(axis=0)


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


def index_key(cartridges) -> str:
    """Where the kvstore keeps the index of a fleet of these cartridges (by their content)."""
    return "fleet-index:" + hashlib.sha256("|".join(c.cartridge_id for c in cartridges).encode()).hexdigest()[:32]


@dataclass
class FleetIndex:
    """A fleet's index: its documents, each chunk's document and embedding, and their mean."""

    names: list[str]
    owners: np.ndarray  # [chunks]: the document of each chunk
    embeddings: np.ndarray  # [chunks, n_embd], centred and of unit length
    mean: np.ndarray  # [n_embd]: what was subtracted
    model: dict  # model_identity of the model that made it
    where: str  # where it was read, for messages

    @classmethod
    def from_file(cls, path: Path) -> FleetIndex:
        file = SafetensorsFile(path)
        meta = file.metadata
        if meta.get("format") != INDEX_FORMAT:
            raise ModelLoadError(f"{path} is not a fleet index (no format {INDEX_FORMAT!r} in its metadata)")
        embeddings, mean = (floats(dtype, raw, shape) for dtype, shape, raw in map(file.raw, ("embeddings", "mean")))
        return cls(json.loads(meta["documents"]), np.asarray(json.loads(meta["chunk_documents"]), dtype=np.int64),
                   embeddings, mean, json.loads(meta.get("model", "{}")), str(path))

    def check(self, engine: Engine) -> None:
        """ModelLoadError unless the engine's model made it."""
        if self.model != model_identity(engine):
            raise ModelLoadError(f"{self.where} was made with another model ({self.model.get('architecture')}, "
                                 f"weights {self.model.get('weights')}): a fleet serves only the model it was made from")
        if self.embeddings.shape != (len(self.owners), engine.model.hp.n_embd):
            raise ModelLoadError(f"{self.where}: embeddings are {list(self.embeddings.shape)}, not "
                                 f"[{len(self.owners)}, {engine.model.hp.n_embd}]")

    def to_record(self) -> tuple[bytes, bytes]:
        """(data, metadata) for the kvstore."""
        data = np.ascontiguousarray(self.embeddings, np.float32).tobytes() + self.mean.astype(np.float32).tobytes()
        meta = json.dumps({"format": INDEX_FORMAT, "documents": self.names, "chunk_documents": self.owners.tolist(),
                           "model": self.model, "width": int(self.mean.shape[0])}).encode()
        return data, meta

    @classmethod
    def from_record(cls, data: bytes, meta: bytes, where: str) -> FleetIndex:
        try:
            info = json.loads(meta)
            width, owners = int(info["width"]), np.asarray(info["chunk_documents"], dtype=np.int64)
            values = np.frombuffer(data, dtype=np.float32)
            if info["format"] != INDEX_FORMAT or values.size != (len(owners) + 1) * width:
                raise ValueError("its size does not match its description")
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{where} is unusable ({exc})") from exc
        return cls(info["documents"], owners, values[:-width].reshape(len(owners), width), values[-width:].copy(),
                   info["model"], where)


@dataclass(frozen=True)
class Retrieval:
    """The knobs: cartridges per conversation, chunks scanned, whether later turns may switch."""

    docs: int = 1
    chunks: int = 8
    adaptive: bool = False
    margin: float = 0.05


class Fleet:
    """A loaded fleet: its cartridges, its index, and the choices made per conversation."""

    def __init__(self, engine: Engine, cartridges: dict[str, Cartridge], embeddings: np.ndarray,
                 mean: np.ndarray, owners: np.ndarray, retrieval: Retrieval, store=None):
        self.engine, self.cartridges = engine, cartridges
        self.names = list(cartridges)
        self.embeddings, self.mean, self.owners = embeddings, mean, owners
        self.retrieval = retrieval
        self.vocab = engine.model.hp.n_vocab
        self.store = store  # a kvstore (get/put): where choices are shared; None: this process only
        self.fleet_id = index_key(cartridges.values())
        self.lock = threading.Lock()
        self.local: OrderedDict[str, list[str]] = OrderedDict()

    @classmethod
    def load(cls, folder: str | os.PathLike, engine: Engine, retrieval: Retrieval, store=None) -> Fleet:
        """The fleet in ``folder``: its cartridges, and its index from ``index.safetensors`` (then
        put in the kvstore, where it is kept beside the choices) or, where the folder holds none,
        from the kvstore, found by its cartridges."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelLoadError(f"fleet directory not found: {folder}")
        index_path = folder / INDEX_FILE
        if index_path.is_file():
            index = FleetIndex.from_file(index_path)
            index.check(engine)  # before the cartridges: the index names the model that made them
            names = index.names
        else:
            names = sorted(p.stem for p in folder.glob("*.safetensors"))
            index = None
        cartridges = {}
        for name in names:
            path = folder / f"{name}.safetensors"
            if not path.is_file():
                raise ModelLoadError(f"{folder}: the index names {name}, whose cartridge {path.name} is missing")
            cartridges[name] = Cartridge.load(path, engine)
        key = index_key(cartridges.values())
        if index is None:
            record = store.get(key) if store is not None and cartridges else None
            if record is None:
                raise ModelLoadError(f"{folder} holds no {INDEX_FILE}, and no kvstore holds one for its cartridges: "
                                     f"make a fleet with 'lmserve cartridge fleet DOCS_DIR --out {folder}'")
            index = FleetIndex.from_record(*record, where=f"the kvstore's index of {folder}")
            if index.names != names:
                raise ModelLoadError(f"the kvstore's index of {folder} names {index.names}, not its cartridges {names}")
        elif store is not None and store.get(key) is None:
            store.put(key, *index.to_record())
        index.check(engine)
        if retrieval.docs > len(names):
            raise ModelLoadError(f"--rag-docs {retrieval.docs} asks for more cartridges than the fleet's "
                                 f"{len(names)} documents")
        return cls(engine, cartridges, index.embeddings, index.mean, index.owners, retrieval, store)

    @property
    def prefix_tokens(self) -> int:
        """The most positions a conversation's composed prefix may take."""
        sizes = sorted((c.tokens for c in self.cartridges.values()), reverse=True)
        return sum(sizes[:self.retrieval.docs])

    def scores(self, query: list[int]) -> dict[str, float]:
        """Each document's score for a query: its best chunk's cosine similarity among the
        ``chunks`` nearest; documents with no chunk there score their best anywhere, minus 2 (so
        they rank after every document that has one)."""
        q = unit(embed(self.engine, query) - self.mean)
        similarity = self.embeddings @ q
        nearest = np.argsort(-similarity)[:self.retrieval.chunks]
        scores = {name: -3.0 for name in self.names}
        for d, name in enumerate(self.names):
            mine = similarity[self.owners == d]
            if mine.size:
                scores[name] = float(mine.max()) - 2.0
        for i in nearest:
            name = self.names[self.owners[i]]
            scores[name] = max(scores[name], float(similarity[i]))
        return scores

    def choose(self, conversation: str | None, query: list[int]) -> list[str]:
        """The documents a conversation is served with: kept from its earlier turns, else (or
        when ``adaptive`` and an outside document out-scores the weakest chosen one by the
        margin) the best ``docs`` for this query."""
        kept = self.recall(conversation) if conversation else None
        if kept and (not self.retrieval.adaptive or not query):
            metrics.FLEET_CHOICES.labels("kept").inc()
            return kept
        if not query:  # nothing to go by (an empty message): the first documents
            metrics.FLEET_CHOICES.labels("new").inc()
            return self.names[:self.retrieval.docs]
        scores = self.scores(query)
        best = sorted(self.names, key=lambda n: -scores[n])[:self.retrieval.docs]
        if kept:
            outside = [scores[n] for n in self.names if n not in kept]
            if not outside or max(outside) <= min(scores[n] for n in kept) + self.retrieval.margin:
                metrics.FLEET_CHOICES.labels("kept").inc()
                return kept
        metrics.FLEET_CHOICES.labels("switched" if kept else "new").inc()
        if conversation:
            self.remember(conversation, best)
        return best

    # --- the choices ----------------------------------------------------------------------------

    def _key(self, conversation: str) -> str:
        # one digest of the fleet and the conversation: a client's session id never becomes a
        # key's text (nor, in a directory store, a file name)
        digest = hashlib.sha256(f"{self.fleet_id}\0{conversation}".encode()).hexdigest()[:32]
        return f"fleet-choice:{digest}"

    def recall(self, conversation: str) -> list[str] | None:
        if self.store is not None:
            held = self.store.get(self._key(conversation))
            names = json.loads(held[0]) if held else None
        else:
            with self.lock:
                names = self.local.get(conversation)
        return names if names and all(n in self.cartridges for n in names) else None

    def remember(self, conversation: str, names: list[str]) -> None:
        if self.store is not None:
            self.store.put(self._key(conversation), json.dumps(names).encode(), b"")
            return
        with self.lock:
            self.local[conversation] = names
            self.local.move_to_end(conversation)
            while len(self.local) > MAX_LOCAL_CHOICES:
                self.local.popitem(last=False)
