"""``lmserve generate``: complete one prompt in this process and print the speeds."""

from __future__ import annotations

import sys

from shared.command_line import EnvParser, new_parser
from shared.sampling_params import SamplingParams
from worker.engine.engine import Engine, GenerationStats
from worker.flags import add_model_flags


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
    from shared.default_model import default_model_path
    engine = Engine.load(args.model or default_model_path())
    tokenizer = engine.tokenizer
    if args.raw or engine.template is None:
        prompt = tokenizer.encode(args.prompt)
    else:
        text = engine.template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special=False)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    stats = GenerationStats()
    decoder = tokenizer.incremental_decoder(skip_special=True)
    for token in engine.generate(prompt, params, args.max_tokens, stats=stats):
        sys.stdout.write(decoder.push(token.token_id))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    print(f"[{stats.prompt_tokens} prompt tokens at {stats.prefill_tokens_per_second:.1f} tok/s prefill; "
          f"{stats.completion_tokens} completion tokens at {stats.decode_tokens_per_second:.1f} tok/s decode; "
          f"finish: {stats.finish_reason}]", file=sys.stderr)
    return 0
