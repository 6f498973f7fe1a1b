"""The worker's command-line flags, apart from the engine: ``lmserve serve`` builds its
children's command lines from this parser without importing numba and the kernels."""

from __future__ import annotations

import argparse
import os

from kvstore.chunks import DEFAULT_CHUNK_TOKENS
from shared import log_format
from shared.command_line import CommaList, EnvParser, env_name, new_parser
from shared.errors import InvalidRequestError
from shared.protocol import DEFAULT_ENDPOINT, DEFAULT_QUEUE, HEARTBEAT_TIMEOUT
from shared.sampling_params import SamplingDefaults
from worker.speculation_settings import SpeculationSettings


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=os.environ.get(env_name("--model")),
                   help="GGUF model file (a split model's first part), a known name (lmserve models) or a "
                        "Hugging Face Hub model, OWNER/REPO[:QUANT] or OWNER/REPO:FILE.gguf, fetched into the Hub's "
                        "cache once (default: SmolLM2-135M-Instruct) [env LMSERVE_MODEL]")
    p.add_argument("--nanochat", metavar="DIR", default=None,
                   help="serve a nanochat checkpoint directory instead of a GGUF file (model.safetensors, "
                        "tokenizer.json, and config.json or nanochat's meta_*.json)")


def metrics_host(endpoint: str) -> str:
    """Where the worker's metrics listen: the host its tcp endpoint binds (a wildcard as all
    addresses), loopback for any other transport."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


def model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The model the flags name: --nanochat's directory, or the positional model (a GGUF file,
    a known name, or a checkpoint directory too). --nanochat is folded into ``args.model``."""
    if args.nanochat is None:
        return args.model
    if args.model and args.model != args.nanochat:
        parser.error("give either a model or --nanochat DIR, not both")
    if not os.path.isdir(args.nanochat):
        parser.error(f"--nanochat {args.nanochat}: not a directory (a nanochat checkpoint directory holds "
                     "model.safetensors and tokenizer.json)")
    args.model, args.nanochat = args.nanochat, None
    return args.model


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own (or for a base model "
                        "that has none, whose chat requests are otherwise refused)")
    p.add_argument("--ctx", type=int, default=0,
                   help="per-request context budget in tokens, prompt and completion together "
                        "(0: the model's trained context, reduced if --kv-slots full caches (at least "
                        "4) would not fit in half of the memory available)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads of the compute kernels (0: every core this process may use)")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f16",
                   help="how the KV cache holds keys and values: f16 (half the memory of f32, "
                        "resident and spilled alike) or f32")
    p.add_argument("--experts", choices=("borrow",), default="borrow",
                   help="how mixture-of-experts weights are held: 'borrow' (the only mode) reads them "
                        "in place from the memory-mapped file, only the routed experts' blocks")
    p.add_argument("--cartridge", metavar="FILE", default=None,
                   help="a KV prefix (lmserve cartridge init) put before every conversation; its positions "
                        "come out of the context budget")
    p.add_argument("--cartridges", metavar="FILE,…", action=CommaList, default=[],
                   help="more cartridges a request may name (its 'cartridges' field: file name without "
                        ".safetensors) to be served behind instead of --cartridge")
    p.add_argument("--fleet", metavar="DIR", default=None,
                   help="a fleet (lmserve cartridge fleet): each conversation is served behind the cartridges "
                        "of the documents its last user message retrieves; excludes --cartridge")
    p.add_argument("--rag-docs", type=int, default=1,
                   help="with --fleet: cartridges composed per conversation (default 1)")
    p.add_argument("--rag-chunks", type=int, default=8,
                   help="with --fleet: nearest index chunks scanned for a message (default 8)")
    p.add_argument("--rag-adaptive", action="store_true",
                   help="with --fleet: a later turn switches when an outside document out-scores the weakest "
                        "chosen one by --rag-margin (else the first turn's choice is kept)")
    p.add_argument("--rag-margin", type=float, default=0.05,
                   help="with --rag-adaptive: the cosine margin a switch needs (default 0.05)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the worker's Prometheus metrics on this port (0: not at all), on the host of "
                        "the worker's tcp endpoint (loopback for ipc)")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE, help="max queued requests before 429")
    p.add_argument("--batch", type=int, default=1,
                   help="lockstep-decode up to N requests together (raises --kv-slots to N)")
    p.add_argument("--kv-slots", type=int, default=0,
                   help="resident KV-reuse slots, each able to hold a full --ctx cache (0: as many as "
                        "half of the memory available holds, from 4 to 16; a slot costs only what it holds)")
    p.add_argument("--kv-budget", type=int, default=0, metavar="TOKENS",
                   help="KV positions the resident caches hold together: past it, the least recently used idle "
                        "conversations' caches are dropped (their whole chunks stay in the kvstore); running streams "
                        "are never cut (0: --ctx, one full context, as one buffer of --ctx cells would hold)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens computed per step while other streams decode")
    p.add_argument("--spec", action=CommaList, default=list(SpeculationSettings.kinds), metavar="KIND,…",
                   help="speculative decoding: what drafts the tokens each weight pass verifies, ngram (a "
                        "lookup in what the stream has read and written), draft (--draft MODEL), mtp (the "
                        "model's own multi-token-prediction layers, Qwen3.5's), a list of them tried in "
                        "order, or off. It never changes a token of a reply "
                        f"(default {','.join(SpeculationSettings.kinds)})")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="a small model of the same vocabulary that drafts for --spec draft (a GGUF path, a "
                        "known name or OWNER/REPO[:QUANT] of the Hugging Face Hub); given, --spec defaults to "
                        "ngram,draft")
    p.add_argument("--spec-max", type=int, default=SpeculationSettings.max_draft, metavar="N",
                   help=f"drafted tokens verified per pass at most (default {SpeculationSettings.max_draft})")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT,
                   help="seconds of silence after which a gateway's requests are ended")
    add_sampling_flags(p)
    p.add_argument("--kv-store", default=None,
                   help="Redis URL of the kvstore (redis://host:6379/0): evicted KV spills there, "
                        "and any worker of the same model restores it")
    p.add_argument("--kv-store-password", default=None, metavar="PASSWORD",
                   help="the Redis password, where the --kv-store URL carries none (better from the environment)")
    p.add_argument("--kv-secret", default=None, metavar="FILE",
                   help="the secret that authenticates kvstore records: a file, or the secret itself; every "
                        "worker sharing a store needs the same one (default: this machine's own, made once in "
                        "the cache directory; lmserve keys --kv-secret FILE writes one)")
    p.add_argument("--kv-cache-dir", default=None,
                   help="spill evicted KV to files under this directory (the embedded kvstore)")
    p.add_argument("--kv-disk-slots", type=int, default=8,
                   help="size bound of --kv-cache-dir, in full --ctx caches")
    p.add_argument("--kv-chunk", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per spilled KV chunk")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """What a request that leaves a sampling field unset samples with, over the model file's
    recommendation (general.sampling.*); a request's own value wins over both."""
    for flag, kind, what in (("--temperature", float, "temperature"), ("--top-p", float, "top_p"),
                             ("--top-k", int, "top_k (0: off)"), ("--min-p", float, "min_p"),
                             ("--repeat-penalty", float, "repetition penalty (1: off)")):
        p.add_argument(flag, type=kind, default=None, metavar="X",
                       help=f"the default {what} of requests that send none (default: the model file's "
                            f"general.sampling recommendation, else the API's)")


def sampling_flags(args: argparse.Namespace) -> SamplingDefaults:
    return SamplingDefaults(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repeat_penalty)


def add_wire_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wire-key", default=None, metavar="FILE",
                   help="this worker's CURVE secret key (a .key_secret file from lmserve keys, or the key's "
                        "Z85 text): the wire is then encrypted, and only --wire-allow gateways are answered")
    p.add_argument("--wire-allow", action=CommaList, default=[], metavar="FILE",
                   help="the gateways' CURVE public keys (.key files, directories of them, or Z85 texts)")
    p.add_argument("--wire-insecure", action="store_true",
                   help="serve the wire in the clear on a non-loopback endpoint, to any peer (without it, such "
                        "a worker needs --wire-key)")


def check_worker_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("ctx", "queue", "batch", "kv_slots", "kv_budget", "prefill_chunk", "kv_disk_slots", "kv_chunk",
                 "threads"):
        if getattr(args, name) < (0 if name in ("queue", "ctx", "threads", "kv_slots", "kv_budget") else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if 0 < args.ctx < 16:
        p.error("--ctx must be at least 16 tokens")
    if args.fleet and args.cartridge:
        p.error("--fleet excludes --cartridge: a fleet chooses each conversation's cartridges itself")
    if args.rag_docs < 1 or args.rag_chunks < 1:
        p.error("--rag-docs and --rag-chunks must be at least 1")
    if not args.rag_margin >= 0:
        p.error("--rag-margin must be 0 or more")
    if args.top_p == 0:
        p.error("--top-p must be in (0, 1]")
    try:
        sampling_flags(args).params()
    except InvalidRequestError as exc:
        p.error(f"a sampling flag is out of range: {exc.message}")


def build_parser() -> EnvParser:
    p = new_parser("lmserve worker", "Own the engine; serve gateways over ZeroMQ.")
    add_model_flags(p)
    p.add_argument("--worker", default=DEFAULT_ENDPOINT,
                   help="ZeroMQ endpoint of the worker (tcp://host:port or ipc://path)")
    add_wire_flags(p)
    add_worker_flags(p)
    log_format.add_log_format_flag(p)
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
