#!/usr/bin/env python3
"""Structured outputs' cost: a batch of requests, each constrained by a JSON schema,
against the same batch unconstrained (issue 15's target: <= 10% slower).

Both runs make exactly ``--max-tokens`` tokens per request, so that both do the same
steps over the same batch sizes: unconstrained rows ignore EOS; constrained rows
follow a schema that cannot finish in time (an array of at least 10,000 short
strings), so each ends with "length" too. The model is the default one (real
weights: the grammar needs its tokenizer); ``--load-format dummy`` draws random
weights instead, which changes nothing for the masks. Prints output tokens/s of
each, the ratio, and the share of the constrained run's wall time the host spends
building masks (``_add_token_bitmask``: the matchers' masks and their copy queued;
applying them runs on the device inside the sampler).

Usage: python bench/bench_structured.py [--requests 64] [--max-tokens 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

from pagedcore import LLM, SamplingParams, default_model_path
from pagedcore.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 10000,
                             "items": {"type": "string", "maxLength": 8}}},
    "required": ["items"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--model", default=None, help="a model directory (default: the default model); with "
                    "--load-format dummy its config and tokenizer are enough")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(model=args.model or default_model_path(), device=args.device, load_format=args.load_format)
    engine = llm.llm_engine
    prompts = [f"Request {i}: list some short words as JSON." for i in range(args.requests)]
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(prompts[:4], [free] * 4, use_tqdm=False)  # warm-up (and grammar compile)
    llm.generate(prompts[:4], [constrained] * 4, use_tqdm=False)

    # Time spent on masks: wrap the two hooks.
    spent = [0.0]
    add_mask = engine._add_token_bitmask

    def timed_add_mask(md, batch):
        t0 = time.perf_counter()
        add_mask(md, batch)
        spent[0] += time.perf_counter() - t0

    engine._add_token_bitmask = timed_add_mask

    def run(params: SamplingParams) -> tuple[float, int]:
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        reasons = {c.finish_reason for o in outs for c in o.outputs}
        assert reasons == {"length"}, reasons
        return best, tokens

    t_free, n_free = run(free)
    spent[0] = 0.0
    t_con, n_con = run(constrained)
    mask_share = spent[0] / args.repeats / t_con
    print(f"{args.requests} requests x {args.max_tokens} tokens on {engine.device}")
    print(f"unconstrained: {n_free / t_free:10.1f} output tokens/s ({t_free:.3f} s)")
    print(f"JSON schema:   {n_con / t_con:10.1f} output tokens/s ({t_con:.3f} s)")
    print(f"constrained / unconstrained throughput: {(n_con / t_con) / (n_free / t_free):.3f} "
          f"(target >= 0.90); host time computing masks: {100 * mask_share:.1f}% of the constrained run")


if __name__ == "__main__":
    main()
