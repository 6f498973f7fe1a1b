"""One rule for every process's command line: flags may also come from the environment.

Each flag ``--some-flag`` may also come from ``LMSERVE_SOME_FLAG`` (for containers); a flag on
the command line wins over the environment, which wins over the default. A list flag (such as
``--allow-host``) takes comma-separated values, on the command line and in the environment.

The flags themselves live with the process that owns them (``gateway/flags.py``,
``worker/flags.py``, ``launcher/flags.py``); each builds its parser with ``new_parser``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

ENV_PREFIX = "LMSERVE_"
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


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose option defaults can come from LMSERVE_* variables, and which
    keeps the arguments it was given (``arguments``, ``options``) for the code that hands one
    process's settings to another."""

    def __init__(self, *args: Any, **kwargs: Any):
        # A malformed variable is reported when parsing, like a malformed flag, not as a traceback.
        self.env_errors: list[str] = []
        self.arguments: list[argparse.Action] = []  # every argument added, in order, but --help
        super().__init__(*args, **kwargs)

    @property
    def options(self) -> list[argparse.Action]:
        """The ``--flag`` options, without --help."""
        return [action for action in self.arguments if action.option_strings]

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        if kwargs.get("action") == "help":
            return super().add_argument(*names, **kwargs)
        flags = [n for n in names if n.startswith("--")]
        if flags:
            variable = env_name(flags[0])
            if variable in os.environ:
                try:
                    kwargs["default"] = _from_environment(os.environ[variable], kwargs)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    self.env_errors.append(f"{variable}={os.environ[variable]!r} is not a valid value for {flags[0]}")
            if kwargs.get("help") and kwargs.get("help") != argparse.SUPPRESS:
                kwargs["help"] = f"{kwargs['help']} [env {variable}]"
        action = super().add_argument(*names, **kwargs)
        self.arguments.append(action)
        return action

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


def new_parser(prog: str, description: str) -> EnvParser:
    return EnvParser(prog=prog, description=description)
