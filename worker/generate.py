"""``lmserve generate``: complete one prompt in this process and print the speeds.

The prompt runs through the worker's own scheduler (the loop the server runs), in-process and
without sockets: the same prompt chunks, sampling and stop rules as a served request.
"""

from __future__ import annotations

import sys
import time

from shared.chat_template import chat_template_from_metadata
from shared.command_line import EnvParser, new_parser
from shared.protocol import Finished, FinishReason, Generate, Message, Rejected, Tokens
from shared.sampling_params import SamplingParams
from worker.engine import Engine
from worker.engine.compile_ahead import describe
from worker.flags import add_model_flags
from worker.scheduler import Scheduler, SchedulerSettings


def build_parser() -> EnvParser:
    p = new_parser("lmserve generate", "Complete one prompt in-process; print prefill and decode tokens/s.")
    add_model_flags(p)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.default_model import resolve_model
    engine = Engine.load(resolve_model(args.model))
    # every kernel compiled (a first start on this CPU) or read from the cache before the
    # clock starts: the speeds below are the engine's, not the compiler's
    engine.warm_up(on_compile=lambda jobs: print(f"lmserve generate: compiling kernels for this CPU, once: "
                                                 f"{describe(jobs)}", file=sys.stderr, flush=True))
    tokenizer = engine.tokenizer
    template = chat_template_from_metadata(engine.metadata, engine.tokenizer)
    if args.raw or template is None:
        prompt = tokenizer.encode(args.prompt)
    else:
        text = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special=False)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    decoder = tokenizer.incremental_decoder(skip_special=True)
    times: list[float] = []  # when each TOKENS message came
    counts: list[int] = []  # and how many tokens it held (a text-diffusion model sends blocks)
    finished: list[Finished] = []
    refused: list[Rejected] = []

    def receive(_gateway: bytes, message: Message) -> None:
        if isinstance(message, Tokens):
            times.append(time.perf_counter())
            counts.append(len(message.ids))
            for token_id in message.ids:
                sys.stdout.write(decoder.push(token_id))
            sys.stdout.flush()
        elif isinstance(message, Finished):
            finished.append(message)
        elif isinstance(message, Rejected):
            refused.append(message)

    ctx = min(engine.model.hp.context_length, len(prompt) + args.max_tokens + 1)
    scheduler = Scheduler(engine, SchedulerSettings(ctx=ctx, queue=0), receive)
    scheduler.submit(b"", Generate("generate", prompt, params, args.max_tokens))
    started = time.perf_counter()
    scheduler.admit()
    while scheduler.running:
        scheduler.step()
    sys.stdout.write(decoder.flush() + "\n")
    if refused:
        print(f"lmserve generate: {refused[0].message}", file=sys.stderr)
        return 2
    done = finished[0]
    prefill = times[0] - started if times else 0.0
    decode = times[-1] - times[0] if len(times) > 1 else 0.0
    print(f"[{done.prompt_tokens} prompt tokens at {done.prompt_tokens / prefill if prefill else 0.0:.1f} tok/s "
          f"prefill; {done.completion_tokens} completion tokens at "
          f"{sum(counts[1:]) / decode if decode else 0.0:.1f} tok/s decode; finish: {done.reason.value}]",
          file=sys.stderr)
    return 1 if done.reason == FinishReason.ERROR else 0
