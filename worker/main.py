"""``lmserve worker``: load the model and serve token-level requests over ZeroMQ."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from kvstore.store import open_store
from shared import log_format
from shared import settings as flags
from shared.errors import LmserveError
from shared.load_progress import ProgressBar, StatusWriter
from worker.engine.engine import Engine
from worker.kv_spill import KVSpiller
from worker.scheduler import SchedulerSettings
from worker.scripted import ScriptedReplies
from worker.server import WorkerServer, WorkerSettings

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


def _spiller(args, engine: Engine) -> KVSpiller | None:
    cache = engine.new_cache(1)
    budget = args.kv_disk_slots * args.ctx * cache.bytes_per_token
    store = open_store(redis_url=args.kv_store, directory=args.kv_cache_dir, max_bytes=budget)
    return KVSpiller(store, engine.fingerprint, args.kv_chunk) if store is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    flags.check_worker_flags(parser, args)
    log_format.configure(args.log_format)
    log = logging.getLogger("lmserve.worker")
    status = StatusWriter(args.status_fd) if args.status_fd is not None else None
    try:
        from shared.default_model import default_model_path
        path = args.model or str(default_model_path())
        started = time.perf_counter()
        # Under lmserve serve the parent draws the bar; alone on a terminal, we do.
        bar = ProgressBar(sys.stderr, f"loading {os.path.basename(path)}") \
            if status is None and sys.stderr.isatty() else None
        try:
            engine = Engine.load(path, status.loading if status else bar.update if bar else None)
        finally:
            if bar is not None:
                bar.finish()
        log.info("loaded %s (%s, %.0f MB of weights) in %.1f s", engine.model_id, engine.architecture,
                 engine.model.weight_bytes / 1e6, time.perf_counter() - started)
        scripted = ScriptedReplies.load(args.scripted_replies, engine.tokenizer) \
            if args.scripted_replies else None
        if scripted is not None:
            log.warning("scripted replies from %s: answers are replayed, not sampled (a test setup)",
                        args.scripted_replies)
        spiller = _spiller(args, engine)
        if spiller is not None:
            log.info("kvstore: %s, %d-token chunks", spiller.store.describe(), spiller.chunk_tokens)
        server = WorkerServer(engine, WorkerSettings(
            spiller=spiller,
            endpoint=args.worker, heartbeat_timeout=args.heartbeat_timeout,
            scheduler=SchedulerSettings(ctx=args.ctx, queue=args.queue, batch=args.batch,
                                        kv_slots=max(args.kv_slots, args.batch),
                                        prefill_chunk=args.prefill_chunk,
                                        scripted_replies=scripted)))
    except LmserveError as exc:
        print(f"lmserve worker: {exc.message}", file=sys.stderr)
        return 2
    if status is not None:  # bound and loaded: gateways can connect now
        status.ready(engine.model_id, args.worker)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
