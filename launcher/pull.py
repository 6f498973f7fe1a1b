"""``lmserve pull OWNER/REPO[:QUANT|:FILE.gguf]``: fetch a model from the Hugging Face Hub into
its cache ahead of serving it, and print where it is."""

from __future__ import annotations

import argparse
import sys

from shared.hub import NAMING, PREFERRED_TAG, cache_location, fetch, parse_hub_name

ABOUT = f"""Fetches the GGUF a Hub name picks into the Hugging Face cache (every part of a split
model) and prints the path to serve; 'lmserve serve NAME' fetches the same way on first use.

  OWNER/REPO:QUANT      the GGUF whose name holds the tag, in any case (Q8_0: model-Q8_0.gguf)
  OWNER/REPO            the {PREFERRED_TAG} one where the repository has it, else its first GGUF
  OWNER/REPO:FILE.gguf  that file

Vision projectors (mmproj files) are never picked. The huggingface_hub library fetches, with its
environment: HF_TOKEN (gated and private repositories; accept a gated model's licence on its
page first), HF_ENDPOINT (a mirror), HF_HOME or HF_HUB_CACHE (where the cache is),
HF_HUB_OFFLINE=1 (only what the cache holds)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve pull", description=ABOUT,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="OWNER/REPO[:QUANT|:FILE.gguf]",
                        help="e.g. Qwen/Qwen3-0.6B-GGUF:Q8_0 or Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name = parse_hub_name(args.model)
    if name is None:
        parser.error(f"{args.model!r} is not a Hub model's name, {NAMING}")
    model = fetch(name)
    parts = f" and its {len(model.files) - 1} other parts beside it" if len(model.files) > 1 else ""
    print(f"lmserve pull: {name} is {model.files[0]}{parts} ({model.commit[:12]}), in {cache_location()}",
          file=sys.stderr)
    print(model.path)
    return 0
