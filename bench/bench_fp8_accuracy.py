"""Accuracy of the fp8 (e4m3) KV cache on the default model's real weights, on the CPU.

The model runs in float32 throughout; only the cache changes, so every difference
is the cache's quantization error. Caches: ``float32`` (the reference); ``fp8 x1``
(scales of 1, ``calculate_kv_scales=False``); ``fp8 /448``: scales calculated at
start-up, amax / 448 for K and V (the engine's calibration text); ``fp8 /200,100``:
the same with vLLM's divisors (K 200, V 100). Controls: one scale of 0.6 .. 0.9 for
every layer. e4m3's relative precision does not depend on the scale except near 0
(subnormals) and at the saturation limit, so a control is "x1" with the roundings
falling elsewhere: the spread of x1 and the controls is the noise band of each
metric, against which the calculated scales are judged.

Measured for each:

1. over a fixed text (bench/fp8_heldout.txt: 1.3k tokens of public-domain prose, none
   of it in the calibration text), prefilled at once with attention reading every key
   back from the cache: perplexity, mean KL(float32 || cache) of the next-token
   distributions, and how often the cache's top-1 token is float32's;
2. over 16 held-out prompts (8 plain, 8 in the chat template) and float32's 32
   greedy tokens after each: the same KL and top-1 agreement, teacher-forced along
   float32's continuation; and free-running greedy decoding through ``LLM.generate``
   (decode steps), tokens equal to float32's at the same position and the mean
   common prefix.

The fp8 cache on the CPU stores e4m3 as the CUDA kernels do and reads it back in
float32 (pagedcore/ops/cpu_fp8.py). Deterministic: greedy, fixed inputs.

Usage: python bench/bench_fp8_accuracy.py [--threads N]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

from pagedcore import LLM, SamplingParams, default_model_path, ops
from pagedcore.kv_scales import calculate_kv_scales, calibration_token_ids
from pagedcore.models import AttentionMetadata

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TOKENS = 32

PLAIN_PROMPTS = [
    "The three most important inventions of the nineteenth century were",
    "In a small village at the foot of the mountains, there lived an old clockmaker who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The recipe calls for two cups of flour, one egg, and",
    "Photosynthesis is the process by which plants",
    "Dear hiring manager, I am writing to apply for the position of",
    "The main causes of the French Revolution can be summarized as follows:",
    "Once upon a time, a young fox found a golden key in the forest. She",
]
CHAT_PROMPTS = [
    "What is the difference between weather and climate?",
    "Write a haiku about the sea at night.",
    "How do I reverse a list in Python?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a short packing list for a weekend camping trip.",
    "What are the health benefits of walking every day?",
    "Translate 'good morning, how are you?' into French.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def prompts(tokenizer) -> list[list[int]]:
    plain = [tokenizer(p)["input_ids"] for p in PLAIN_PROMPTS]
    chat = []
    for p in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                            add_generation_prompt=True)
        chat.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return plain + chat


# (name, how the layers' scales are set): None = 1; a float = that scale for every
# layer (a control: e4m3's relative precision is the same at any scale, so a
# non-power-of-two constant gives other rounding at the same expected error, and the
# spread between it and "x1" is the metrics' noise); a pair = calculated, amax / (K, V).
CONFIGS = [("float32", None), ("fp8 x1", None), ("fp8 /448", (448.0, 448.0)), ("fp8 /200,100", (200.0, 100.0))]
CONTROLS = [0.6, 0.7, 0.8, 0.9]  # with x1: the noise band (no free-running generation)


@torch.inference_mode()
def forward_logprobs(model, ids: list[int], kv_dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """float64 log-softmax ``[len(ids), vocab]`` of one sequence, prefilled at once over
    fresh caches of ``kv_dtype`` (attention reads every key back from the cache)."""
    spec, n = model.spec, len(ids)
    blocks = -(-n // block_size)
    shape = (1 + blocks, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape).to(kv_dtype), torch.zeros(shape).to(kv_dtype)) for _ in range(spec.num_layers)]
    md = AttentionMetadata(
        slot_mapping=torch.arange(block_size, block_size + n, dtype=torch.int32),
        block_tables=torch.arange(1, 1 + blocks, dtype=torch.int32)[None, :],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    hidden = model(torch.tensor(ids, dtype=torch.int32), torch.arange(n, dtype=torch.int32), md, caches)
    return torch.log_softmax(model.compute_logits(hidden).double(), dim=-1)


def set_scales(model, tokenizer, how) -> None:
    if isinstance(how, tuple):
        calculate_kv_scales(model, calibration_token_ids(tokenizer), *how)
        return
    for layer in model.layers:
        layer.k_scale = layer.v_scale = 1.0 if how is None else how


def compare(ref: torch.Tensor, got: torch.Tensor, targets: list[int]) -> dict[str, float]:
    """Over the rows of ref/got (log-softmax) predicting ``targets``: summed log-likelihood,
    KL(ref || got), top-1 agreement."""
    t = torch.tensor(targets)
    rows = torch.arange(len(targets))
    return {
        "loglik": got[rows, t].sum().item(),
        "kl": (ref.exp() * (ref - got)).sum(-1).sum().item(),
        "top1": (ref.argmax(-1) == got.argmax(-1)).sum().item(),
        "n": len(targets),
        "max_dlogprob": (ref[rows, t] - got[rows, t]).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the ops (default: theirs)")
    args = parser.parse_args()
    if args.threads:
        ops.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    kw = dict(model=default_model_path(), device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048,
              enable_prefix_caching=False)
    f32 = LLM(**kw)
    fp8 = LLM(**kw, kv_cache_dtype="fp8", calculate_kv_scales=False)
    tok = f32.llm_engine.tokenizer
    text = tok(open(os.path.join(HERE, "fp8_heldout.txt"), encoding="utf-8").read())["input_ids"]
    ps = prompts(tok)
    greedy_params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ref_greedy = [list(o.outputs[0].token_ids) for o in
                  f32.generate([{"prompt_token_ids": p} for p in ps], greedy_params, use_tqdm=False)]
    model = fp8.llm_engine.model
    ref_text = forward_logprobs(model, text, torch.float32)
    ref_forced = [forward_logprobs(model, p + g, torch.float32)[len(p) - 1:-1] for p, g in zip(ps, ref_greedy)]
    rows = []
    for name, how in CONFIGS + [(f"fp8 x{c:g} (control)", c) for c in CONTROLS]:
        set_scales(model, tok, how)
        scales = [(layer.k_scale, layer.v_scale) for layer in model.layers]
        kv = torch.float32 if name == "float32" else torch.float8_e4m3fn
        on_text = compare(ref_text[:-1], forward_logprobs(model, text, kv)[:-1], text[1:])
        forced = [compare(r, forward_logprobs(model, p + g, kv)[len(p) - 1:-1], g)
                  for p, g, r in zip(ps, ref_greedy, ref_forced)]
        llm = f32 if name == "float32" else fp8
        greedy = None if "control" in name else [
            list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in ps], greedy_params, use_tqdm=False)]
        rows.append((name, scales, on_text, forced, greedy))

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    print(f"# fp8 KV-cache accuracy: {os.path.basename(default_model_path())}, float32 weights and "
          f"arithmetic on the CPU, commit {commit}; text of {len(text)} tokens; {len(ps)} prompts x {NEW_TOKENS} "
          f"greedy tokens")
    print("| cache | k_scale / v_scale (min..max) | text: perplexity | text: KL(f32 || cache) mean | "
          "text: top-1 = f32 | prompts: KL mean, f32's continuation | prompts: top-1 = f32 | "
          "free-running greedy = f32 (mean common prefix) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    total = NEW_TOKENS * len(ps)
    for name, scales, on_text, forced, greedy in rows:
        ks, vs = [k for k, _ in scales], [v for _, v in scales]
        scale_text = "1 / 1" if name == "float32" else f"{min(ks):.3g}..{max(ks):.3g} / {min(vs):.3g}..{max(vs):.3g}"
        ppl = math.exp(-on_text["loglik"] / on_text["n"])
        kl_p = sum(f["kl"] for f in forced) / total
        top_p = sum(f["top1"] for f in forced)
        free = "-"
        if greedy is not None:
            equal = sum(a == b for g, r in zip(greedy, ref_greedy) for a, b in zip(g, r))
            prefix = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), NEW_TOKENS)
                         for g, r in zip(greedy, ref_greedy)) / len(ps)
            free = f"{equal}/{total} ({100 * equal / total:.1f}%, {prefix:.1f})"
        print(f"| {name} | {scale_text} | {ppl:.4f} | {on_text['kl'] / on_text['n']:.5f} | "
              f"{on_text['top1']}/{on_text['n']} ({100 * on_text['top1'] / on_text['n']:.1f}%) | {kl_p:.5f} | "
              f"{top_p}/{total} ({100 * top_p / total:.1f}%) | {free} |")
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
