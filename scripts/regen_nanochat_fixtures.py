"""Regenerate the nanochat logit fixtures from independent implementations, with torch.

    python scripts/regen_nanochat_fixtures.py --nanochat-src DIR

in a venv with torch (CPU), transformers 5.23, safetensors, numpy and tokenizers (the tiny
checkpoints are written by ``tests/tiny_nanochat.py``, which imports lmserve's vocabulary
helpers, so the repo must be importable). It writes, in ``tests/fixtures``:

* ``logits_nanochat_hf.npz``: the ``"hf"`` layout run by transformers' ``NanoChatForCausalLM``
  (eager attention, float32);
* ``logits_nanochat_native.npz``: the ``"native"`` layout run by nanochat's own ``GPT``
  (``nanochat/gpt.py`` of a nanochat source tree, ``--nanochat-src``; on a CPU it computes in
  float32 and attends through torch's SDPA with its sliding-window mask).

Both are fed 160 token ids (past the 129 positions of the short window) from a fixed seed,
all at once from an empty cache. Each file holds what ``fixture_files.save_fixture`` writes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

import torch  # noqa: E402
from fixture_files import save_fixture, sha256_of  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_nanochat import N_EMBD, N_HEAD, N_KV_HEAD, N_LAYER, SEQUENCE_LEN, write_tiny_nanochat  # noqa: E402

TOKEN_SEED, TOKEN_COUNT = 1234, 160


def tokens_for(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(TOKEN_SEED).integers(0, vocab, size=TOKEN_COUNT)]


def hf_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from transformers import NanoChatForCausalLM

    model = NanoChatForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def native_logits(folder: Path, tokens: list[int], vocab: int, source: Path) -> np.ndarray:
    sys.path.insert(0, str(source))
    from nanochat.gpt import GPT, GPTConfig

    config = GPTConfig(sequence_len=SEQUENCE_LEN, vocab_size=vocab, n_layer=N_LAYER, n_head=N_HEAD,
                       n_kv_head=N_KV_HEAD, n_embd=N_EMBD, window_pattern="SSSL")
    model = GPT(config)
    model.init_weights()  # the rotary tables; every weight is then replaced by the checkpoint's
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].float().numpy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanochat-src", type=Path, required=True, help="a nanochat source tree (holds nanochat/gpt.py)")
    parser.add_argument("--nanochat-commit", default="unknown", help="recorded in the fixture's meta")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for layout in ("hf", "native"):
            info = write_tiny_nanochat(Path(scratch) / layout, layout)
            folder = Path(info["path"])
            tokens = tokens_for(info["vocab"])
            if layout == "hf":
                logits = hf_logits(folder, tokens)
                reference = f"transformers {importlib.metadata.version('transformers')} NanoChatForCausalLM"
            else:
                logits = native_logits(folder, tokens, info["vocab"], args.nanochat_src)
                reference = f"nanochat gpt.py at {args.nanochat_commit}"
            meta = {"name": f"nanochat_{layout}", "reference": reference, "torch": torch.__version__,
                    "eval": "one forward of the whole token list, float32, no cache",
                    "model": {"kind": "tiny_nanochat.write_tiny_nanochat", **info, "path": None,
                              "sha256": sha256_of(folder / "model.safetensors")},
                    "tokens": {"kind": "numpy default_rng integers", "seed": TOKEN_SEED, "count": TOKEN_COUNT}}
            save_fixture(f"nanochat_{layout}", tokens, logits[:, :info["vocab"]], meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
