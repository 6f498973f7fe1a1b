"""How cached KV is addressed: fixed chunks of tokens, each named by a chained hash.

A chunk's key hashes the model fingerprint (weights and KV geometry), the prefix ids
(cartridges) and every token up to the chunk's end, so two prompts share a chunk key exactly
when they share everything the chunk's keys and values depend on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


DEFAULT_CHUNK_TOKENS = 256
KEY_PREFIX = "lmserve:kv:"


def chunk_keys(fingerprint: str, tokens: Sequence[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               prefix_ids: Sequence[str] = ()) -> list[str]:
    """Keys of every full chunk of ``tokens``, in order."""
    running = hashlib.sha256(f"{fingerprint}|{','.join(prefix_ids)}".encode())
    keys = []
    chunk_format = f"<{chunk_tokens}i"  # int32, little-endian
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        running.update(struct.pack(chunk_format, *tokens[start:start + chunk_tokens]))
        keys.append(KEY_PREFIX + running.copy().hexdigest()[:40])
    return keys
