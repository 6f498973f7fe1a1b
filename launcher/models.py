"""``lmserve models``: the models a MODEL argument may name, and whether each is here yet; then
the GGUF models the Hugging Face cache holds."""

from __future__ import annotations

import sys

from shared.default_model import DEFAULT_MODEL_ID, MODELS, model_path
from shared.errors import ModelLoadError
from shared.hub import NAMING, cache_location, cached_models


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
          f"Any other MODEL is a GGUF file's path, or a model of the Hugging Face Hub.")
    print_hub_cache()
    return 0


def print_hub_cache() -> None:
    cached = cached_models()
    print(f"\nFrom the Hugging Face Hub, in {cache_location()}:" if cached
          else f"\nNothing from the Hugging Face Hub in {cache_location()} yet.")
    if cached:
        width = max(len(model.repo) for model in cached) + 2
        print(f"{'repository':<{width}} {'quant':<10} {'size':>10}  file")
        for model in cached:
            parts = f" (+{len(model.files) - 1} parts)" if len(model.files) > 1 else ""
            print(f"{model.repo:<{width}} {model.tag or '-':<10} {model.size / 1e6:>7.1f} MB  {model.files[0]}{parts}")
    print(f"A Hub model is named {NAMING}; lmserve pull NAME fetches one ahead of serving it.")
