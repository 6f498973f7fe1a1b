"""``lmserve worker``: load the model and serve token-level requests over ZeroMQ."""

from __future__ import annotations

import logging
import signal
import sys
import time

from shared import settings as flags
from shared.errors import LmserveError
from worker.engine.engine import Engine
from worker.scheduler import SchedulerSettings
from worker.server import WorkerServer, WorkerSettings

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def build_parser():
    p = flags.new_parser("lmserve worker", "Own the engine; serve gateways over ZeroMQ.")
    flags.add_model_flags(p)
    flags.add_worker_endpoint_flag(p, DEFAULT_ENDPOINT)
    flags.add_worker_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    flags.check_worker_flags(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("lmserve.worker")
    try:
        from shared.default_model import default_model_path
        path = args.model or str(default_model_path())
        started = time.perf_counter()
        engine = Engine.load(path)
        log.info("loaded %s (%s, %.0f MB of weights) in %.1f s", engine.model_id, engine.architecture,
                 engine.model.weight_bytes / 1e6, time.perf_counter() - started)
        server = WorkerServer(engine, WorkerSettings(
            endpoint=args.worker, heartbeat_timeout=args.heartbeat_timeout,
            scheduler=SchedulerSettings(ctx=args.ctx, queue=args.queue, batch=args.batch,
                                        kv_slots=max(args.kv_slots, args.batch),
                                        prefill_chunk=args.prefill_chunk)))
    except LmserveError as exc:
        print(f"lmserve worker: {exc.message}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
