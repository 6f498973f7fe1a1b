"""Command-line flags for every role, in one place, with one rule for environment variables.

Each flag ``--some-flag`` may also come from ``LMSERVE_SOME_FLAG`` (for containers); a flag on
the command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

ENV_PREFIX = "LMSERVE_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class _EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose option defaults can come from LMSERVE_* variables."""

    def add_argument(self, *names: str, **kwargs):  # type: ignore[override]
        flags = [n for n in names if n.startswith("--")]
        if flags:
            variable = env_name(flags[0])
            if variable in os.environ:
                raw = os.environ[variable]
                if kwargs.get("action") == "store_true":
                    kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    convert = kwargs.get("type", str)
                    kwargs["default"] = convert(raw)
            if kwargs.get("help") and kwargs.get("help") != argparse.SUPPRESS:
                kwargs["help"] = f"{kwargs['help']} [env {variable}]"
        return super().add_argument(*names, **kwargs)


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return _EnvDefaults(prog=prog, description=description)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=os.environ.get(env_name("--model")),
                   help="GGUF model file (default: SmolLM2-135M-Instruct, fetched once) [env LMSERVE_MODEL]")


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", type=int, default=4096,
                   help="per-request context budget in tokens, prompt and completion together")
    p.add_argument("--queue", type=int, default=16, help="max queued requests before 429")
    p.add_argument("--batch", type=int, default=1,
                   help="lockstep-decode up to N requests together (raises --kv-slots to N)")
    p.add_argument("--kv-slots", type=int, default=1,
                   help="resident KV-reuse slots; each can hold a full --ctx cache")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens computed per step while other streams decode")
    p.add_argument("--heartbeat-timeout", type=float, default=6.0,
                   help="seconds of silence after which a gateway's requests are ended")


def add_worker_endpoint_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--worker", default=default,
                   help="ZeroMQ endpoint of the worker (tcp://host:port or ipc://path)")


def check_worker_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("ctx", "queue", "batch", "kv_slots", "prefill_chunk"):
        if getattr(args, name) < (0 if name == "queue" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.ctx < 16:
        p.error("--ctx must be at least 16 tokens")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return p.parse_args(argv)
