"""``lmserve serve``'s flags: every flag of the roles it starts, and the command lines that hand
them on to its children unchanged."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from gateway.flags import add_gateway_flags
from shared.command_line import CommaList, EnvParser, new_parser
from worker.flags import add_model_flags, add_worker_flags


def build_parser() -> EnvParser:
    p = new_parser("lmserve serve", "Run worker(s) and gateway(s) on this machine.")
    add_model_flags(p)
    add_gateway_flags(p)
    p.add_argument("--gateways", type=int, default=1, help="gateway processes sharing the port")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes, each a replica of the model; the gateways route between them")
    p.add_argument("--worker", default="",
                   help="ZeroMQ endpoint(s) between the gateways and the workers, comma-separated, one per "
                        "worker (default: free loopback ports)")
    add_worker_flags(p)
    return p


def to_argv(p: EnvParser, args: argparse.Namespace,
            skip: Callable[[argparse.Action], bool] = lambda _: False) -> list[str]:
    """Command-line flags that make ``p`` parse to the values in ``args`` (for the options
    ``p`` and ``args`` share), so one role can start another with the settings it was given."""
    argv: list[str] = []
    for action in p.options:
        if skip(action) or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch (store_true): present or absent
            argv += [flag] if value else []
        elif isinstance(action, CommaList):
            argv += [flag, ",".join(value)] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv
