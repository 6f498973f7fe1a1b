"""The worker's command-line flags, apart from the engine: ``lmserve serve`` builds its
children's command lines from this parser without importing numba and the kernels."""

from __future__ import annotations

from shared import settings as flags

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def build_parser():
    p = flags.new_parser("lmserve worker", "Own the engine; serve gateways over ZeroMQ.")
    flags.add_model_flags(p)
    flags.add_worker_endpoint_flag(p, DEFAULT_ENDPOINT)
    flags.add_worker_flags(p)
    flags.add_log_flags(p)
    p.add_argument("--status-fd", type=int, default=None,
                   help="file descriptor to write load progress and readiness to, as JSON lines "
                        "(lmserve serve passes a pipe here)")
    p.add_argument("--scripted-replies", metavar="FILE", default=None,
                   help="FOR TESTS ONLY: instead of sampling, answer with scripted replies (the forward "
                        "pass still runs). FILE is a JSON list; a reply is a list of token ids or "
                        "{\"text\": ...} or {\"ids\": [...]}, optionally with \"when\": MARKER. A request "
                        "gets the keyed reply whose marker occurs latest in its prompt, else the next "
                        "unkeyed reply in turn (cycling); each reply ends with the end-of-turn token")
    return p
