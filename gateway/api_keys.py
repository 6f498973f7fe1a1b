"""The API keys a gateway accepts: ``--api-key`` keys (named ``key1``, ``key2``, … in order) and
``--api-keys-file`` entries, one a line, ``name:key`` or ``name:sha256:HEX`` (the key's SHA-256,
so the file need hold no secret); blank lines and ``#`` comments are skipped.

Every key is held as its SHA-256 and an offered key is hashed and compared in constant time, so
plain and hashed entries are checked alike. The file is read again on SIGHUP: a file that no
longer reads leaves the keys as they were.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import LmserveError

HASHED = "sha256:"
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
log = logging.getLogger("lmserve.gateway")


@dataclass(frozen=True)
class ApiKey:
    name: str  # what the access log and the metrics say: never the key
    digest: bytes  # the key's SHA-256


def key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def read_keys_file(path: str) -> list[ApiKey]:
    """The keys of a keys file; a line that is not ``name:key`` or ``name:sha256:HEX`` (or a
    name given twice) is refused with its line number."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmserveError(f"--api-keys-file {path}: cannot read it ({exc})")
    keys: list[ApiKey] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, secret = line.partition(":")
        name, secret = name.strip(), secret.strip()
        where = f"--api-keys-file {path} line {number}"
        if not colon or not name or not secret:
            raise LmserveError(f"{where}: not NAME:KEY or NAME:sha256:HEX")
        if name in names:
            raise LmserveError(f"{where}: the name {name!r} is already given to another key")
        if secret.startswith(HASHED):
            hexdigest = secret.removeprefix(HASHED)
            if not _HEX_DIGEST.fullmatch(hexdigest):
                raise LmserveError(f"{where}: a hashed key is sha256: and 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        else:
            digest = key_digest(secret.encode())
        names.add(name)
        keys.append(ApiKey(name, digest))
    return keys


class KeyRing:
    """The keys in force; ``reload`` swaps in the file's keys as one list."""

    def __init__(self, api_keys: list[str], keys_file: str | None = None):
        self.flag_keys = [ApiKey(f"key{i}", key_digest(key.encode())) for i, key in enumerate(api_keys, 1)]
        self.keys_file = keys_file
        self.keys = self.flag_keys + (read_keys_file(keys_file) if keys_file else [])
        if keys_file:
            log.info("API keys: %d from --api-keys-file %s, %d from --api-key", len(self.keys) - len(self.flag_keys),
                     keys_file, len(self.flag_keys))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def reload(self) -> None:
        """Read the keys file again (SIGHUP); on an error the keys in force stay."""
        if not self.keys_file:
            log.info("SIGHUP: no --api-keys-file to reload")
            return
        try:
            loaded = read_keys_file(self.keys_file)
        except LmserveError as exc:
            log.error("SIGHUP: the API keys stay as they were (%d): %s", len(self.keys), exc.message)
            return
        self.keys = self.flag_keys + loaded
        log.info("SIGHUP: reloaded %d API keys from %s (%d in force with --api-key's)", len(loaded),
                 self.keys_file, len(self.keys))

    def match(self, offered: list[bytes]) -> ApiKey | None:
        """The key one of the offered ones is, if any. Every comparison is made, each in
        constant time: which key matched is not timed either."""
        digests = [key_digest(candidate) for candidate in offered]
        keys = self.keys  # one list throughout, whatever a reload does meanwhile
        hits = [sum(hmac.compare_digest(digest, key.digest) for digest in digests) for key in keys]
        return next((key for key, hit in zip(keys, hits) if hit), None)
