#!/usr/bin/env python3
"""What a cap on the prompt tokens of steps with decode rows
(``max_num_mixed_prefill_tokens``, with ``mixed_prefill_max_waiting``) does to
the serving benchmark's figures, by simulation: bench_serving.py's workload
(lognormal prompts, half behind 4 system prompts of 512 that the prefix cache
holds after their first use, Poisson arrivals) through the scheduler's rule
(decode rows first, then running prefills and admissions under the budget and
the cap), each step costing ``a + b * decode rows + c * prompt tokens`` ms.

The costs are fitted to the H200 run of issue 14 (5d8e8d5, bench/RESULTS.md):
the 8B shape's decode-only steps (6.2 ms with ~40 rows, 12.4 ms with 256) and
its prefill steps (175 ms for ~8k tokens: 21 us a token); SmolLM2's (1.3 ms
with ~20 rows, 2.5 ms with 512; 2.7 us a token). The simulation reproduces that
run's 8B figures without a cap (ITL p50/p99 6.4/27.5 ms at 0.5x against
6.51/27.36 measured): a guide for the default, which the GPU run then measures
(run_serving_gpu.sh runs 0.5x with the cap and without it).

Usage: python bench/sim_mixed_prefill.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import math
import random

# shape: (a, b, c) ms, requests, own-prompt median, output tokens, max_num_seqs
SHAPES = {
    "llama3-8b": ((5.0, 0.029, 0.021), 256, 300, 256, 256),
    "smollm2": ((1.3, 0.0023, 0.0027), 512, 200, 128, 512),
}
BUDGET = 8192  # max_num_batched_tokens on CUDA


def workload(n: int, median: float, seed: int) -> list[tuple[int, int, int]]:
    """(own tokens, shared tokens, system prompt) per request, as bench_serving.make_prompts."""
    rng, out, shared_seen = random.Random(seed), [], 0
    for i in range(n):
        own = max(4, int(rng.lognormvariate(math.log(median), 0.6)))
        if (i + 1) * 0.5 >= shared_seen + 1:
            out.append((own, 512, shared_seen % 4))
            shared_seen += 1
        else:
            out.append((own, 0, -1))
    return out


def simulate(shape: str, rate: float, cap: int, max_waiting: int, seed: int) -> tuple[float, list, list]:
    """Returns (duration ms, inter-token gaps ms, TTFTs ms)."""
    (a, b, c), n, median, out_tokens, max_seqs = SHAPES[shape]
    prompts = workload(n, median, seed)
    rng, t, arrivals = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate) * 1e3
    cached: set[int] = set()
    waiting: list[list] = []
    running: list[list] = []  # [request, prompt tokens left, outputs left]
    now, i, done, gaps, ttfts = 0.0, 0, 0, [], []
    while done < n:
        while i < n and arrivals[i] <= now:
            own, shared, system = prompts[i]
            hit = shared if system in cached else 0
            if shared:
                cached.add(system)
            waiting.append([i, own + shared - hit, out_tokens])
            i += 1
        if not waiting and not running:
            now = arrivals[i]
            continue
        decodes = [r for r in running if r[1] == 0]
        budget = BUDGET
        prefill = min(cap, budget) if cap and decodes and len(waiting) <= max_waiting else budget
        budget -= len(decodes)
        tokens, first = 0, []
        for r in running:
            if r[1] > 0:
                take = min(r[1], budget, prefill)
                r[1] -= take
                budget, prefill, tokens = budget - take, prefill - take, tokens + take
                if take and r[1] == 0:
                    first.append(r)
        while waiting and budget > 0 and prefill > 0 and len(running) < max_seqs:
            r = waiting.pop(0)
            take = min(r[1], budget, prefill)
            r[1] -= take
            budget, prefill, tokens = budget - take, prefill - take, tokens + take
            running.append(r)
            if r[1] == 0:
                first.append(r)
        step = a + b * len(decodes) + c * tokens
        now += step
        for r in decodes:
            gaps.append(step)
            r[2] -= 1
        for r in first:
            r[2] -= 1
            ttfts.append(now - arrivals[r[0]])
        for r in [r for r in running if r[1] == 0 and r[2] <= 0]:
            running.remove(r)
            done += 1
    return now, gaps, ttfts


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--caps", type=int, nargs="+", default=[0, 128, 256, 512])
    p.add_argument("--max-waiting", type=int, nargs="+", default=[8, 1 << 30])
    args = p.parse_args()
    print(f"{'shape':<10}{'cap':>5}{'lifted >':>9}{'inf tok/s':>11}{'ITL p50/p99 @0.5x':>20}{'p99/p50':>9}"
          f"{'TTFT p99 @0.5x':>16}")
    for shape, (_, n, _, out_tokens, _) in SHAPES.items():
        sat = n / (simulate(shape, math.inf, 0, 0, 0)[0] / 1e3)  # requests/s without a cap
        for cap in args.caps:
            for max_waiting in (args.max_waiting if cap else [0]):
                duration = simulate(shape, math.inf, cap, max_waiting, 0)[0]
                gaps, ttfts = [], []
                for seed in range(args.seeds):
                    _, g, t = simulate(shape, 0.5 * sat, cap, max_waiting, seed)
                    gaps += g
                    ttfts += t
                p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
                lifted = "-" if not cap else ("never" if max_waiting >= 1 << 30 else str(max_waiting))
                print(f"{shape:<10}{cap:>5}{lifted:>9}{n * out_tokens / (duration / 1e3):>11.0f}"
                      f"{p50:>13.2f}/{p99:<6.2f}{p99 / p50:>9.2f}{percentile(ttfts, 99):>16.1f}")


if __name__ == "__main__":
    main()
