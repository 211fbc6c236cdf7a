"""``pagedcore`` command line: ``pagedcore generate "prompt" [--model M] ...``."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedcore", description="pagedcore: LLM inference over a paged KV cache")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return _generate(args)
    except ValueError as e:
        print(f"pagedcore: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
