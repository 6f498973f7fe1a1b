"""``lmserve serve``: the one-command local stack.

Starts a worker and the gateway(s) as child processes on this machine, waits for them, and
takes them all down together: Ctrl-C or SIGTERM is forwarded to every child, and if any child
dies the others are stopped and the command exits non-zero naming it.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time

from shared import settings as flags


def build_parser():
    p = flags.new_parser("lmserve serve", "Run a worker and gateway(s) on this machine.")
    flags.add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address of the HTTP gateway")
    p.add_argument("--port", type=int, default=8080, help="HTTP port")
    p.add_argument("--gateways", type=int, default=1, help="gateway processes sharing the port")
    flags.add_worker_endpoint_flag(p, "")
    flags.add_worker_flags(p)
    return p


def _free_tcp_endpoint() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    flags.check_worker_flags(parser, args)
    from shared.default_model import default_model_path
    model = args.model or str(default_model_path())
    endpoint = args.worker or _free_tcp_endpoint()
    python = [sys.executable, "-m", "shared.cli"]
    children: dict[str, subprocess.Popen] = {}
    worker_cmd = python + ["worker", model, "--worker", endpoint, "--ctx", str(args.ctx),
                           "--queue", str(args.queue), "--batch", str(args.batch),
                           "--kv-slots", str(args.kv_slots), "--prefill-chunk", str(args.prefill_chunk),
                           "--heartbeat-timeout", str(args.heartbeat_timeout)]
    children["worker"] = subprocess.Popen(worker_cmd)
    if importlib.util.find_spec("gateway.main") is not None:
        for i in range(args.gateways):
            children[f"gateway {i + 1}"] = subprocess.Popen(
                python + ["gateway", "--worker", endpoint, "--host", args.host, "--port", str(args.port)])
    else:
        print(f"lmserve serve: worker on {endpoint} (no HTTP gateway in this build)", file=sys.stderr)

    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    exit_code = 0
    while children:
        for name, child in list(children.items()):
            code = child.poll()
            if code is None:
                continue
            del children[name]
            if not stopping:
                print(f"lmserve serve: {name} exited with code {code}; stopping the others", file=sys.stderr)
                exit_code = code or 1
                forward(signal.SIGTERM, None)
        time.sleep(0.1)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
