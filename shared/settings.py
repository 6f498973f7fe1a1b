"""Command-line flags for every role, in one place, with one rule for environment variables.

Each flag ``--some-flag`` may also come from ``LMSERVE_SOME_FLAG`` (for containers); a flag on
the command line wins over the environment, which wins over the default. A list flag (such as
``--allow-host``) takes comma-separated values, on the command line and in the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.chunks import DEFAULT_CHUNK_TOKENS

ENV_PREFIX = "LMSERVE_"
LOG_FORMATS = ("text", "json")
TRUE_WORDS = ("1", "true", "yes", "on")


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def comma_list(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


class CommaList(argparse.Action):
    """A repeatable flag whose values may also be comma-separated: ``--x a,b --x c`` -> [a, b, c].

    The first use on the command line replaces a default that came from the environment
    (the command line wins), later uses add to it.
    """

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, items + comma_list(values))


class _EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose option defaults can come from LMSERVE_* variables."""

    def __init__(self, *args: Any, **kwargs: Any):
        # A malformed variable is reported when parsing, like a malformed flag, not as a traceback.
        self.env_errors: list[str] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        flags = [n for n in names if n.startswith("--")]
        if flags and kwargs.get("action") != "help":
            variable = env_name(flags[0])
            if variable in os.environ:
                try:
                    kwargs["default"] = _from_environment(os.environ[variable], kwargs)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    self.env_errors.append(f"{variable}={os.environ[variable]!r} is not a valid value for {flags[0]}")
            if kwargs.get("help") and kwargs.get("help") != argparse.SUPPRESS:
                kwargs["help"] = f"{kwargs['help']} [env {variable}]"
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        if self.env_errors:
            self.error("; ".join(self.env_errors))
        return super().parse_known_args(args, namespace)


def _from_environment(raw: str, kwargs: dict[str, Any]) -> Any:
    action = kwargs.get("action")
    if action == "store_true":
        return raw.strip().lower() in TRUE_WORDS
    if action is CommaList:
        return comma_list(raw)
    value = kwargs.get("type", str)(raw)
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"not one of {choices}")
    return value


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return _EnvDefaults(prog=prog, description=description)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=os.environ.get(env_name("--model")),
                   help="GGUF model file (default: SmolLM2-135M-Instruct, fetched once) [env LMSERVE_MODEL]")


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", type=int, default=0,
                   help="per-request context budget in tokens, prompt and completion together "
                        "(0: the model's trained context, reduced if --kv-slots full caches would "
                        "not fit in half of the memory available)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads of the compute kernels (0: every core this process may use)")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f16",
                   help="how the KV cache holds keys and values: f16 (half the memory of f32, "
                        "resident and spilled alike) or f32")
    p.add_argument("--experts", choices=("borrow",), default="borrow",
                   help="how mixture-of-experts weights are held: 'borrow' (the only mode) reads them "
                        "in place from the memory-mapped file, only the routed experts' blocks")
    p.add_argument("--queue", type=int, default=16, help="max queued requests before 429")
    p.add_argument("--batch", type=int, default=1,
                   help="lockstep-decode up to N requests together (raises --kv-slots to N)")
    p.add_argument("--kv-slots", type=int, default=1,
                   help="resident KV-reuse slots; each can hold a full --ctx cache")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens computed per step while other streams decode")
    p.add_argument("--heartbeat-timeout", type=float, default=6.0,
                   help="seconds of silence after which a gateway's requests are ended")
    p.add_argument("--kv-store", default=None,
                   help="Redis URL of the kvstore (redis://host:6379/0): evicted KV spills there, "
                        "and any worker of the same model restores it")
    p.add_argument("--kv-cache-dir", default=None,
                   help="spill evicted KV to files under this directory (the embedded kvstore)")
    p.add_argument("--kv-disk-slots", type=int, default=8,
                   help="size bound of --kv-cache-dir, in full --ctx caches")
    p.add_argument("--kv-chunk", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per spilled KV chunk")


def add_worker_endpoint_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--worker", default=default,
                   help="ZeroMQ endpoint of the worker (tcp://host:port or ipc://path)")


def add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="log lines as readable text or as one JSON object per line")


def check_worker_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("ctx", "queue", "batch", "kv_slots", "prefill_chunk", "kv_disk_slots", "kv_chunk", "threads"):
        if getattr(args, name) < (0 if name in ("queue", "ctx", "threads") else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if 0 < args.ctx < 16:
        p.error("--ctx must be at least 16 tokens")


def option_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's ``--flag`` options, without --help."""
    return [a for a in p._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def to_argv(p: argparse.ArgumentParser, args: argparse.Namespace,
            skip: Callable[[argparse.Action], bool] = lambda _: False) -> list[str]:
    """Command-line flags that make ``p`` parse to the values in ``args`` (for the options
    ``p`` and ``args`` share), so one role can start another with the settings it was given."""
    argv: list[str] = []
    for action in option_actions(p):
        if skip(action) or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, CommaList):
            argv += [flag, ",".join(value)] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return p.parse_args(argv)
