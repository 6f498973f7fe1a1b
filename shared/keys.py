"""Secret material: the kvstore's MAC secret and the wire's CURVE key pairs.

A flag naming a secret takes a file (as a Kubernetes Secret or a compose volume provides it) or
the secret's text itself (as an environment variable from a Secret provides it). Files are
written readable by their owner only.

    lmserve keys NAME… [--dir DIR]        a CURVE key pair per NAME: DIR/NAME.key (public) and
                                           DIR/NAME.key_secret (secret), pyzmq's certificate files
    lmserve keys --kv-secret FILE         a random kvstore secret
    lmserve keys --redis-password FILE    a random Redis password
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from shared.errors import LmserveError

KV_SECRET_FILE = "kv-secret"  # the machine's own, under the cache directory, when no --kv-secret is given
MIN_SECRET_BYTES = 16
Z85_KEY_LENGTH = 40  # a CURVE key in Z85 text


def write_private(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only; refuse to replace an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise LmserveError(f"{path} exists already: remove it first to make a new one") from None
    with os.fdopen(fd, "w") as file:
        file.write(text + "\n")


def looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~"))


def read_secret(value: str, flag: str) -> bytes:
    """A secret from a file, or the value itself when no such file exists. A value written as a
    path must name a file: a missing one is an error, never a secret anyone can read in a manifest."""
    path = Path(value).expanduser()
    if looks_like_path(value) and not path.is_file():
        raise LmserveError(f"{flag} {value}: no such file (a secret given as a path must exist; "
                           "lmserve keys --kv-secret FILE writes one)")
    if path.is_file():
        try:
            secret = path.read_bytes().strip()
        except OSError as exc:
            raise LmserveError(f"{flag} {value}: cannot read it ({exc.strerror})") from exc
    else:
        secret = value.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise LmserveError(f"{flag}: the secret has {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES} "
                           "(lmserve keys --kv-secret FILE writes one)")
    return secret


def machine_kv_secret(directory: Path) -> bytes:
    """This machine's kvstore secret, made on first use: the workers of ``lmserve serve`` share
    it, and a restarted worker trusts what it spilled before."""
    path = directory / KV_SECRET_FILE
    if not path.exists():
        # written whole under a name of our own, then linked in: a worker starting at the same
        # moment finds either no file or the whole secret, never an empty one
        partial = directory / f".{KV_SECRET_FILE}.{os.getpid()}"
        try:
            partial.unlink(missing_ok=True)
            write_private(partial, secrets.token_hex(32))
            try:
                os.link(partial, path)
            except FileExistsError:
                pass  # another worker made it first: theirs it is
            finally:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            raise LmserveError(f"cannot make the kvstore secret {path} ({exc.strerror}); give one with "
                               "--kv-secret") from exc
    return read_secret(str(path), "the kvstore secret")


# --- CURVE keys ---------------------------------------------------------------------------------

def _z85_key(text: str) -> bytes | None:
    text = text.strip()
    if len(text) != Z85_KEY_LENGTH:
        return None
    import zmq.utils.z85

    try:
        zmq.utils.z85.decode(text)
    except Exception:  # ValueError, KeyError, struct.error: whatever odd text sets off, it is no key
        return None
    return text.encode()


def secret_key(value: str, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (``lmserve keys``), or from the Z85
    secret key's text."""
    import zmq
    import zmq.auth

    literal = None if os.path.exists(value) else _z85_key(value)
    if literal is not None:
        return zmq.curve_public(literal), literal
    try:
        public, secret = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise LmserveError(f"{flag} {value}: not a secret key file written by lmserve keys, nor a 40-character "
                           f"Z85 secret key ({exc})") from exc
    if not secret:
        raise LmserveError(f"{flag} {value}: this file holds only a public key; give the .key_secret file")
    return public, secret


def public_keys(values: list[str], flag: str) -> set[bytes]:
    """Public keys from certificate files, directories of them, or Z85 texts."""
    import zmq.auth

    keys: set[bytes] = set()
    for value in values:
        literal = None if os.path.exists(value) else _z85_key(value)
        if literal is not None:
            keys.add(literal)
            continue
        paths = sorted(Path(value).glob("*.key")) if os.path.isdir(value) else [Path(value)]
        for path in paths:
            try:
                keys.add(zmq.auth.load_certificate(path)[0])
            except (OSError, ValueError) as exc:
                raise LmserveError(f"{flag} {path}: not a key file written by lmserve keys, nor a "
                                   f"40-character Z85 public key ({exc})") from exc
        if not paths:
            raise LmserveError(f"{flag} {value}: the directory holds no .key files")
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmserve keys", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="a CURVE key pair for each NAME (e.g. worker gateway)")
    p.add_argument("--dir", default=".", help="where the key pairs go (default: here)")
    p.add_argument("--kv-secret", metavar="FILE", default=None, help="write a random kvstore secret to FILE")
    p.add_argument("--redis-password", metavar="FILE", default=None, help="write a random Redis password to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.names or args.kv_secret or args.redis_password):
        parser.error("name at least one key pair, --kv-secret or --redis-password")
    import zmq.auth

    folder = Path(args.dir)
    for name in args.names:
        if not name or "/" in name or name.startswith("."):
            parser.error(f"{name!r} is not a plain name")
        public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
        for path in (public_path, secret_path):
            if path.exists():
                raise LmserveError(f"{path} exists already: remove it first to make a new one")
        folder.mkdir(parents=True, exist_ok=True)
        old_mask = os.umask(0o077)  # the secret file is its owner's alone from its first byte
        try:
            zmq.auth.create_certificates(folder, name)
        finally:
            os.umask(old_mask)
        os.chmod(public_path, 0o644)  # a public key may be read by anyone
        print(f"{public_path} (public) and {secret_path} (secret)")
    for path, what, text in ((args.kv_secret, "kvstore secret", secrets.token_hex(32)),
                             (args.redis_password, "Redis password", secrets.token_urlsafe(32))):
        if path:
            write_private(Path(path), text)
            print(f"{path} ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
