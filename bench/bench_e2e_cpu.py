#!/usr/bin/env python3
"""End to end on the CPU: pagedcore ``LLM.generate`` vs Hugging Face transformers
``generate`` on the same weights (the default model, SmolLM2-135M-Instruct,
float32) and the same prompts.

Workload: N prompts with lognormal lengths (seeded) cut from a fixed text, a
fixed number of output tokens per prompt (EOS ignored on both sides), all
prompts submitted at once. transformers runs its usual batched generate with
left padding (its best offline usage on the CPU). The two runs alternate
(pagedcore, transformers, pagedcore, ...) and the median of each is reported,
since a shared 2-core VM's speed varies from minute to minute.

With ``--tpot``: time per output token at batch 1 instead (issue 11's CPU target): one
prompt, ``generate`` of 1 and of ``--output-tokens`` + 1 tokens, the difference over
``--output-tokens``, for pagedcore and transformers alternately, ``--repeats`` pairs each
(5 by default here), medians; with pagedcore's small-row float32 products on torch's GEMM
too (``ops.LINEAR_MAX_ROWS = 0``: the path before ``ops.linear``), in the same process.

Usage: bench/bench_e2e_cpu.py [--prompts 32] [--output-tokens 64] [--repeats 2] [--tpot]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np
import torch

from corpus import TEXT  # noqa: E402  (bench/ is on sys.path when run as a script)


def make_prompts(tokenizer, n: int, seed: int, mean_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    corpus = tokenizer.encode(TEXT * 40)
    lengths = np.clip(rng.lognormal(np.log(mean_len), 0.6, n).astype(int), 16, 1024)
    starts = rng.integers(0, len(corpus) - 1100, n)
    return [corpus[s : s + int(L)] for s, L in zip(starts, lengths)]


def run_pagedcore(llm, prompts, out_tokens: int) -> float:
    from pagedcore import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == out_tokens for o in outs)
    return elapsed


def run_hf(model, tokenizer, prompts, out_tokens: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=out_tokens,
            min_new_tokens=out_tokens, pad_token_id=pad,
        )
    elapsed = time.perf_counter() - t
    assert out.shape[1] == width + out_tokens
    return elapsed


def tpot(llm, hf, tokenizer, prompt: list[int], out_tokens: int, repeats: int) -> dict[str, list[float]]:
    """Batch-1 ms per output token: (time of out_tokens + 1 tokens - time of 1) / out_tokens."""
    from pagedcore import ops

    def ours(n: int) -> float:
        return run_pagedcore(llm, [prompt], n)

    def theirs(n: int) -> float:
        return run_hf(hf, tokenizer, [prompt], n)

    default_rows = ops.LINEAR_MAX_ROWS
    runs = {"pagedcore": [], "pagedcore, torch GEMM": [], "transformers": []}
    for _ in range(repeats):
        for name in runs:
            if name == "transformers":
                one, many = theirs(1), theirs(out_tokens + 1)
            else:
                ops.LINEAR_MAX_ROWS = default_rows if name == "pagedcore" else 0
                one, many = ours(1), ours(out_tokens + 1)
            runs[name].append((many - one) / out_tokens * 1e3)
    ops.LINEAR_MAX_ROWS = default_rows
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--mean-prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tpot", action="store_true", help="batch-1 time per output token instead")
    args = parser.parse_args()

    import transformers

    import pagedcore
    from pagedcore import LLM

    torch.manual_seed(args.seed)
    path = pagedcore.default_model_path()
    llm = LLM(model=path, max_model_len=2048, num_kv_blocks=4096)
    tokenizer = llm.get_tokenizer()
    prompts = make_prompts(tokenizer, args.prompts, args.seed, args.mean_prompt_len)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None

    # Warm-up (one short run each), then alternate.
    run_pagedcore(llm, prompts[:4], 4)
    run_hf(hf, tokenizer, prompts[:4], 4)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.tpot:
        runs = tpot(llm, hf, tokenizer, prompts[0], args.output_tokens, max(args.repeats, 5))
        print(f"commit {commit}; torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{torch.get_num_threads()} threads; batch 1, a {len(prompts[0])}-token prompt, "
              f"{args.output_tokens} output tokens, greedy")
        print(f"{'ms per output token':<28}{'runs':<40}{'median':>8}")
        for name, values in runs.items():
            print(f"{name:<28}{' '.join(f'{v:.1f}' for v in values):<40}{statistics.median(values):>8.1f}")
        print(f"ratio (transformers / pagedcore, ms per token): "
              f"{statistics.median(runs['transformers']) / statistics.median(runs['pagedcore']):.2f}x")
        return
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(run_pagedcore(llm, prompts, args.output_tokens))
        theirs.append(run_hf(hf, tokenizer, prompts, args.output_tokens))
    out_tokens = args.prompts * args.output_tokens
    lens = [len(p) for p in prompts]
    print(f"commit {commit}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{args.prompts} prompts, lengths mean {statistics.mean(lens):.0f} (min {min(lens)}, "
          f"max {max(lens)}), {args.output_tokens} output tokens each, EOS ignored, greedy")
    print(f"{'engine':<28}{'runs (s)':<24}{'median s':>10}{'out tok/s':>12}")
    for name, times in (("pagedcore LLM.generate", ours), ("transformers generate", theirs)):
        med = statistics.median(times)
        print(f"{name:<28}{' '.join(f'{t:.1f}' for t in times):<24}{med:>10.1f}{out_tokens / med:>12.1f}")
    print(f"ratio (pagedcore / transformers, output tokens/s): "
          f"{statistics.median(theirs) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()
