"""``lmserve worker``: load the model and serve token-level requests over ZeroMQ."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvstore.store import open_store
from shared import log_format
from shared.chat_template import ChatTemplate
from shared.errors import LmserveError
from shared.keys import machine_kv_secret, public_keys, read_secret, secret_key
from shared.load_progress import ProgressBar, StatusWriter
from shared.memory import fix_mmap_threshold, give_back_freed_memory
from worker import metrics
from worker.cartridges.cartridge import Cartridge
from worker.cartridges.fleet import Fleet, Retrieval
from worker.engine import Engine, kernels
from worker.engine.compile_ahead import describe
from worker.flags import build_parser, check_worker_flags, metrics_host, model_argument, sampling_flags
from worker.kv_spill import KVSpiller
from worker.kv_slots import resident_slot_count
from worker.scheduler import SchedulerSettings
from worker.scripted import ScriptedReplies
from worker.speculation import DRAFT, KINDS, MTP, SpeculationSettings
from shared.wire_security import ServerKeys, is_loopback_endpoint
from worker.server import WorkerServer, WorkerSettings

KV_MEMORY_SHARE = 0.5  # of the memory available at start, for --kv-slots full caches
AUTO_SLOTS = (4, 16)  # the fewest and most resident caches --kv-slots 0 chooses


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes of memory available to this process now: the machine's (MemAvailable, else all
    physical memory), or less where its control group's limit leaves less (a container's limit,
    which /proc/meminfo does not show)."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    # cgroup v2 (memory.max, memory.current), else v1 (memory.limit_in_bytes, memory.usage_in_bytes)
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path(cgroup, limit_file).read_text().strip()
            used = int(Path(cgroup, usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < machine + used:  # "max", or v1's huge number: no limit
            return max(0, min(machine, int(limit) - used))
        return machine
    return machine


def context_budget(engine: Engine, kv_slots: int, memory: int, log: logging.Logger) -> int:
    """The model's trained context, or less if kv_slots caches of it would not fit the memory
    share (caches grow as they fill, so this bounds the worst case, not the start)."""
    trained = engine.model.hp.context_length
    cache = engine.new_cache(1)
    if kv_slots * cache.full_bytes(trained) <= memory * KV_MEMORY_SHARE:
        return trained
    low, high = 16, trained  # the longest context whose caches fit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if kv_slots * cache.full_bytes(middle) <= memory * KV_MEMORY_SHARE \
            else (low, middle - 1)
    log.warning("--ctx %d instead of the trained %d: %d KV slots of %d tokens (%.0f MiB each) fit in "
                "half of the %.0f MiB available", low, trained, kv_slots, low,
                cache.full_bytes(low) / 2**20, memory / 2**20)
    return low


def slots_and_context(engine: Engine, kv_slots: int, batch: int, ctx: int, memory: int,
                      log: logging.Logger) -> tuple[int, int]:
    """--kv-slots and --ctx as asked, or (``kv_slots`` 0) as many slots as the memory share holds
    full caches of the context, from AUTO_SLOTS[0] (or --batch) to AUTO_SLOTS[1]: a slot costs
    only what it holds, and each one keeps a conversation's KV resident for its next turn."""
    if kv_slots:
        slots = resident_slot_count(kv_slots, batch)
        return slots, ctx or context_budget(engine, slots, memory, log)
    fewest, most = max(AUTO_SLOTS[0], batch), max(AUTO_SLOTS[1], batch)
    ctx = ctx or context_budget(engine, fewest, memory, log)
    full = engine.new_cache(1).full_bytes(ctx)
    slots = max(fewest, min(most, int(memory * KV_MEMORY_SHARE // max(full, 1))))
    log.info("--kv-slots %d: resident caches of up to %d tokens (%.0f MiB each when full) for that many "
             "conversations, sized from half of the %.0f MiB available", slots, ctx, full / 2**20, memory / 2**20)
    return slots, ctx


def _cartridge(path: str, engine, ctx: int) -> Cartridge:
    cartridge = Cartridge.load(path, engine)
    if cartridge.tokens > ctx - 2:  # a prompt of one token and one generated must fit after it
        raise LmserveError(f"the cartridge {path} takes {cartridge.tokens} positions, which "
                           f"leaves no room in the context budget of {ctx} tokens (--ctx)")
    return cartridge


def _fleet(args, engine: Engine, ctx: int, spiller: KVSpiller | None) -> Fleet:
    retrieval = Retrieval(args.rag_docs, args.rag_chunks, args.rag_adaptive, args.rag_margin)
    fleet = Fleet.load(args.fleet, engine, retrieval, spiller.store if spiller is not None else None)
    if fleet.prefix_tokens > ctx - 2:
        raise LmserveError(f"the fleet's {args.rag_docs} largest cartridges take {fleet.prefix_tokens} positions, "
                           f"which leaves no room in the context budget of {ctx} tokens (--ctx)")
    where = "in the kvstore" if spiller is not None else "in this process (no kvstore)"
    logging.getLogger("lmserve.worker").info(
        "fleet %s: %d documents, %d chunks indexed, %d cartridge(s) a conversation%s; choices kept %s",
        args.fleet, len(fleet.names), len(fleet.owners), args.rag_docs,
        ", adaptive" if args.rag_adaptive else "", where)
    return fleet


RECORD_LIMIT_FLOOR = 256 << 20  # bytes: a recurrent model's states or a fleet's index may exceed a chunk


def _spiller(args, engine: Engine, ctx: int) -> KVSpiller | None:
    if not (args.kv_store or args.kv_cache_dir):
        return None
    cache = engine.new_cache(1)
    budget = args.kv_disk_slots * ctx * cache.bytes_per_token
    from shared.default_model import cache_dir
    secret = read_secret(args.kv_secret, "--kv-secret") if args.kv_secret else machine_kv_secret(cache_dir())
    store = open_store(redis_url=args.kv_store, directory=args.kv_cache_dir, max_bytes=budget, secret=secret,
                       record_limit=max(RECORD_LIMIT_FLOOR, 2 * args.kv_chunk * cache.bytes_per_token),
                       password=args.kv_store_password,
                       on_reject=metrics.KV_CHUNKS.labels("rejected").inc)
    return KVSpiller(store, engine.fingerprint, args.kv_chunk)


def _wire(args) -> ServerKeys | None:
    """The CURVE keys --wire-key and --wire-allow name; None for a wire in the clear, which a
    non-loopback endpoint gets only with --wire-insecure."""
    if not args.wire_key:
        if args.wire_allow:
            raise LmserveError("--wire-allow needs --wire-key: the worker's own secret key")
        if not args.wire_insecure and not is_loopback_endpoint(args.worker):
            raise LmserveError(f"{args.worker} is reachable from other machines, and without --wire-key anyone "
                               "there could use this worker: give it --wire-key and --wire-allow (lmserve keys "
                               "writes them), or --wire-insecure to serve the wire in the clear")
        return None
    public, secret = secret_key(args.wire_key, "--wire-key")
    allowed = public_keys(args.wire_allow, "--wire-allow")
    if not allowed:
        raise LmserveError("--wire-key needs --wire-allow: the public keys of the gateways to answer")
    return ServerKeys(public, secret, frozenset(allowed))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_worker_flags(parser, args)
    log_format.configure(args.log_format)
    log = logging.getLogger("lmserve.worker")
    status = StatusWriter(args.status_fd) if args.status_fd is not None else None
    fix_mmap_threshold()
    try:
        wire = _wire(args)  # before loading: a worker that would refuse its endpoint says so at once
        speculation = speculation_settings(args)
        from shared.default_model import resolve_model
        path = resolve_model(model_argument(parser, args))
        threads = kernels.set_threads(args.threads or None)
        started = time.perf_counter()
        # Under lmserve serve the parent draws the bar; alone on a terminal, we do.
        bar = ProgressBar(sys.stderr, f"loading {os.path.basename(path)}") \
            if status is None and sys.stderr.isatty() else None
        try:
            engine = Engine.load(path, status.loading if status else bar.update if bar else None,
                                 kv_type=args.kv_type)
        finally:
            if bar is not None:
                bar.finish()
        log.info("loaded %s (%s, %.0f MB of weights) in %.1f s, %d threads", engine.model_id,
                 engine.architecture, engine.model.weight_bytes / 1e6, time.perf_counter() - started, threads)
        for name, qtype in engine.model.dense_fallbacks.items():
            log.warning("%s (%s) has no compiled kernel here: held as float32", name, qtype)

        def compiling(jobs: list[str]) -> None:
            what = describe(jobs)
            log.info("compiling kernels for this CPU, once: %s", what)
            if status is not None:
                status.compiling(what)

        def compiled_later(seconds: float) -> None:
            log.info("one stream's block steps compiled in %.1f s after the start: one call a layer from now on",
                     seconds)

        def warm_up() -> None:
            log.info("running each kernel once before serving")
            started = time.perf_counter()
            engine.warm_up(on_compile=compiling, later=compiled_later)
            give_back_freed_memory()  # what loading and compiling freed
            log.info("kernels ready in %.1f s (a first start on this CPU compiles them; later starts read "
                     "numba's disk cache)", time.perf_counter() - started)

        # Every start warms up before it answers anyone: a first one compiles for a minute or
        # more, a later one loads the compiled kernels in under a second. Loading brings some
        # 50-70 MiB of LLVM's code into memory until the warm-up pages it out; warming up while
        # gateways built their view of the model (a tokenizer's transient of their own) and the
        # first requests ran put those peaks together, 70-80 MiB above what the stack serves with.
        warm_up()
        scripted = ScriptedReplies.load(args.scripted_replies, engine.tokenizer) \
            if args.scripted_replies else None
        if scripted is not None:
            log.warning("scripted replies from %s: answers are replayed, not sampled (a test setup)",
                        args.scripted_replies)
        if args.metrics_port:
            metrics.serve(args.metrics_port, metrics_host(args.worker))
        kv_slots, ctx = slots_and_context(engine, args.kv_slots, args.batch, args.ctx, available_memory(), log)
        kv_budget = args.kv_budget or ctx
        log.info("--kv-budget %d: past that many positions in all caches, idle conversations' caches are "
                 "dropped, least recently used first", kv_budget)
        cartridge = _cartridge(args.cartridge, engine, ctx) if args.cartridge else None
        if cartridge is not None:
            log.info("cartridge %s: %d positions before every conversation", cartridge.name, cartridge.tokens)
        library = [_cartridge(path, engine, ctx) for path in args.cartridges]
        names = [c.name for c in ([cartridge] if cartridge else []) + library]
        if len(set(names)) < len(names):
            raise LmserveError(f"two cartridges share a name ({', '.join(names)}): a request names one by its "
                               "file name, so each must differ")
        for each in library:
            log.info("cartridge %s: %d positions, for requests that name it", each.name, each.tokens)
        # a cartridge's pseudo-ids are its own, so the kvstore's chunk keys tell cartridges apart
        spiller = _spiller(args, engine, ctx)
        if spiller is not None:
            log.info("kvstore: %s, %d-token chunks", spiller.store.describe(), spiller.chunk_tokens)
        fleet = _fleet(args, engine, ctx, spiller) if args.fleet else None
        server = WorkerServer(engine, WorkerSettings(
            spiller=spiller, chat_template=_read_template(args.chat_template),
            endpoint=args.worker, heartbeat_timeout=args.heartbeat_timeout, wire=wire,
            sampling=sampling_flags(args),
            scheduler=SchedulerSettings(ctx=ctx, queue=args.queue, batch=args.batch,
                                        kv_slots=kv_slots, kv_budget=kv_budget,
                                        prefill_chunk=args.prefill_chunk, threads=threads,
                                        scripted_replies=scripted, cartridge=cartridge,
                                        library=library, fleet=fleet,
                                        speculation=with_drafters(speculation, args.draft, engine, log))))
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


def speculation_settings(args) -> SpeculationSettings:
    """--spec, --spec-max and --draft, checked before anything loads."""
    if args.draft and args.spec == list(SpeculationSettings.kinds):  # a draft model given: it drafts too
        args.spec = [*args.spec, DRAFT]
    kinds = tuple(kind for kind in args.spec if kind != "off")
    if DRAFT in kinds and not args.draft:
        raise LmserveError("--spec draft needs a draft model: --draft MODEL (a small model of the same vocabulary)")
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise LmserveError(f"--spec {','.join(unknown)}: this worker drafts with {', '.join(KINDS)} (or off)")
    if args.spec_max < 0:
        raise LmserveError("--spec-max must be 0 or more")
    return SpeculationSettings(kinds, args.spec_max)


def with_drafters(settings: SpeculationSettings, draft: str | None, engine: Engine, log) -> SpeculationSettings:
    """The settings with what drafts loaded: the draft model, which must share the target's
    vocabulary token for token; the served model's MTP block, which it must have."""
    if MTP in settings.kinds:
        if not getattr(engine.model, "mtp_layers", 0):
            raise LmserveError(f"--spec mtp: {engine.model_id} ({engine.architecture}) has no multi-token-prediction "
                               "layers (nextn_predict_layers): choose ngram or draft")
        log.info("the model's MTP block drafts for speculative decoding")
        settings = replace(settings, model=engine.model)
    if DRAFT not in settings.kinds:
        return settings
    from shared.default_model import resolve_model

    drafting = Engine.load(resolve_model(draft))
    if drafting.tokenizer.to_spec().tokens != engine.tokenizer.to_spec().tokens:
        raise LmserveError(f"the draft model {drafting.model_id} has another vocabulary than {engine.model_id}: "
                           "its tokens must be the target's, id for id")
    if not drafting.model.new_cache(1).rewindable:
        raise LmserveError(f"the draft model {drafting.model_id} ({drafting.architecture}) keeps recurrent states, "
                           "which cannot be cut back to the tokens a reply kept: choose an attention-only model")
    drafting.warm_up()
    log.info("draft model %s (%s, %.0f MB of weights) drafts for speculative decoding", drafting.model_id,
             drafting.architecture, drafting.model.weight_bytes / 1e6)
    return replace(settings, draft_engine=drafting)


def _read_template(path: str | None) -> str | None:
    if not path:
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LmserveError(f"cannot read the chat template {path}: {exc}") from exc
    ChatTemplate(source)  # a template that does not compile fails here, not on the first request
    return source


if __name__ == "__main__":
    sys.exit(main())
