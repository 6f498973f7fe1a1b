"""``lmserve models``: the models a MODEL argument may name, and whether each is here yet."""

from __future__ import annotations

import sys

from shared.default_model import DEFAULT_MODEL_ID, MODELS, model_path
from shared.errors import ModelLoadError


def main(argv: list[str] | None = None) -> int:
    if argv:
        print("usage: lmserve models  (no arguments)", file=sys.stderr)
        return 2
    print(f"{'name':<24} {'size':>7}  {'here':<5} about")
    for name, model in MODELS.items():
        try:
            here = str(model_path(name, download=False))
        except ModelLoadError:
            here = ""
        print(f"{name:<24} {model.size_mb:>4} MB  {'yes' if here else 'no':<5} {model.about}")
    print(f"\nlmserve serve NAME fetches a model on first use; with no MODEL it serves {DEFAULT_MODEL_ID}. "
          f"Any other MODEL is a GGUF file's path.")
    return 0
