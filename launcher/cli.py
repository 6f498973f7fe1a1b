"""The ``lmserve`` command: one entry point, a subcommand per role.

    lmserve serve [MODEL]      the local stack: a worker and a gateway on 127.0.0.1:8080
    lmserve worker [MODEL]     the engine process alone, serving gateways over ZeroMQ
    lmserve gateway            the HTTP edge alone (--worker tcp://...)
    lmserve generate [MODEL]   complete one prompt in this process and print the speeds
    lmserve models             the models MODEL may name (fetched on first use), the Hub's cached; else a GGUF path
    lmserve pull OWNER/REPO[:QUANT] fetch a GGUF from the Hugging Face Hub, as MODEL OWNER/REPO[:QUANT] does
    lmserve cartridge init DOC a KV prefix of a document, for --cartridge
    lmserve cartridge train DOC… a cartridge trained on documents by self-study (lmserve[train])
    lmserve keys NAME…         CURVE key pairs for the worker wire, a kvstore secret (split deployments)
"""

from __future__ import annotations

import importlib
import sys

from shared.errors import LmserveError

COMMANDS = {
    "serve": "launcher.serve",
    "worker": "worker.main",
    "gateway": "gateway.main",
    "generate": "worker.generate",
    "models": "launcher.models",
    "pull": "launcher.pull",
    "cartridge": "training.command",
    "keys": "shared.keys",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\n`lmserve COMMAND --help` lists a command's flags.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"lmserve: unknown command {command!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command])
    try:
        return module.main(rest)
    except LmserveError as exc:
        print(f"lmserve {command}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
