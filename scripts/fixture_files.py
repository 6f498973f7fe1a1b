"""What the logit fixture scripts share: the fixture file's form (``tests/fixtures/logits_<name>.npz``,
read by the parity tests) and a file's digest."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures"
TOP_K = 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def summarize(logits: np.ndarray) -> dict[str, np.ndarray]:
    # Top-20 per position instead of the whole vocabulary keeps each fixture a few KB.
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
    top_logits = np.take_along_axis(logits, order, axis=-1)
    wide = logits.astype(np.float64)
    peak = wide.max(axis=-1, keepdims=True)
    logsumexp = (peak[:, 0] + np.log(np.exp(wide - peak).sum(axis=-1))).astype(np.float32)
    return {
        "top1": order[:, 0].astype(np.int32),
        "top_ids": order.astype(np.int32),
        "top_logits": top_logits.astype(np.float32),
        "logsumexp": logsumexp,
    }


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez_compressed`` (``np.load`` reads it) but byte-stable: members carry a
    fixed timestamp, so regenerating unchanged logits leaves the committed file unchanged."""
    with zipfile.ZipFile(path, "w") as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.save(buffer, arrays[name], allow_pickle=False)
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            member.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(member, buffer.getvalue())


def save_fixture(name: str, tokens: list[int], logits: np.ndarray, meta: dict[str, Any],
                 extra: dict[str, np.ndarray] | None = None) -> Path:
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    path = FIXTURE_DIR / f"logits_{name}.npz"
    arrays = {"tokens": np.asarray(tokens, dtype=np.int32), **summarize(logits), **(extra or {})}
    arrays["meta"] = np.array(json.dumps(meta, indent=1, sort_keys=True))
    write_npz(path, arrays)
    gap = arrays["top_logits"][:, 0] - arrays["top_logits"][:, 1]
    print(f"  wrote {path.relative_to(REPO_ROOT)} ({path.stat().st_size} bytes): "
          f"{len(tokens)} positions, logit std {logits.std():.2f}, "
          f"smallest top1-top2 gap {gap.min():.4f}")
    return path
