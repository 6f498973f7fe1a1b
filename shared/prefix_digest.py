"""How a worker tells the gateways which prompts it holds warm, and how a gateway measures a
prompt against that: chained digests of fixed blocks of token ids.

The digest of block ``i`` hashes every token up to that block's end, so a worker holding digest
``i`` holds the whole prefix through it. Blocks are small (``ROUTE_BLOCK`` tokens) so a match
is measured finely, and digests are short (8 bytes), since a worker sends all of its resident
slots' digests in every heartbeat. These are routing hints, not the kvstore's chunk keys: a
collision costs a cold prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shared.protocol import pack_ids

ROUTE_BLOCK = 64  # tokens per digest
DIGEST_BYTES = 8


def prefix_digests(tokens: Sequence[int], block: int = ROUTE_BLOCK) -> list[bytes]:
    """The digest of every full block of ``tokens``, in order, each chaining all before it."""
    running = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digests = []
    for start in range(0, len(tokens) - block + 1, block):
        running.update(pack_ids(list(tokens[start:start + block])))
        digests.append(running.copy().digest())
    return digests


def held_prefix(digests: Sequence[bytes], held: set[bytes] | frozenset[bytes], block: int = ROUTE_BLOCK) -> int:
    """How many leading tokens of the prompt whose ``digests`` these are a holder of ``held``
    has: the run of leading digests it holds, in tokens."""
    count = 0
    for digest in digests:
        if digest not in held:
            break
        count += 1
    return count * block
