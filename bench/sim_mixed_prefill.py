#!/usr/bin/env python3
"""What a cap on the tokens of steps with decode rows
(``max_num_mixed_prefill_tokens``, with ``mixed_prefill_max_waiting``) does to
the serving benchmark's figures, by simulation: bench_serving.py's workload
(lognormal prompts, half behind 4 system prompts of 512 that the prefix cache
holds after their first use, Poisson arrivals) through the scheduler's rule
(decode rows first, then running prefills and admissions under the budget and
the cap).

Step costs (ms): a decode-only step ``a + b * rows``; a step with prompt tokens
``a + b * rows + m + c * (padded - rows)`` (``m`` 0 unless ``--costs`` gives it), where ``padded`` is the step's token
count (rows + prompt tokens) rounded up to the runner's piecewise CUDA graphs
(model_runner.PREFILL_GRAPH_TOKENS: 16, 32, ..., 256, 512, ...): the layer
bodies run the padded count. Fitted to the H200 runs of issue 14 at a8d4bb0
(bench/RESULTS.md, the serving table of the fifth session's first GPU calls):
8B decode ~6.2 ms at ~40 rows and ~17 us a prompt token (8B time to first token of 512 tokens: 14.4 ms); SmolLM2 ~1.2 ms
and ~5 us (4.07 ms at 512).

Two rules for the cap (--mode):
- ``prompt`` (the scheduler before issue 14's fifth part): at most ``cap``
  prompt tokens in a step with decode rows. At 0.5x the 8B runs ~40 decode
  rows, so a 256-token chunk makes a 296-token step, padded to 512: a step of
  ~14 ms against 6.4 (SmolLM2: ~3.6 against ~1.3), which is where the measured
  p99s (8B 17.2 ms, SmolLM2 5.3 ms) come from.
- ``total``: the step's tokens (decode rows + prompt tokens) at most ``cap``,
  so that a mixed step fits the graph of ``cap`` tokens (and at least half as
  many prompt tokens as rows while rows fill the cap, so that prompts move on;
  ``cap // 16`` before 43899e5): the scheduler's rule since issue 14's fifth part.
  (The queue's share, ``mixed_prefill_waiting_per_cap``, is not simulated.)

The cap holds while at most ``max_waiting`` requests wait; a longer queue is
admitted with the whole budget (saturation throughput).

Usage: python bench/sim_mixed_prefill.py [--seeds 3] [--mode total prompt]
       [--lift-tokens 0 1024 2048] [--shapes smollm2] [--rate R] [--costs A,B,C]
"""

from __future__ import annotations

import argparse
import bisect
import math
import random

# shape: (a, b, c) ms, requests, own-prompt median, output tokens, max_num_seqs
SHAPES = {
    "llama3-8b": ((5.0, 0.029, 0.017), 256, 300, 256, 256),
    "smollm2": ((1.15, 0.0023, 0.005), 512, 200, 128, 512),
}
# Saturation request rates that the H200 run measured (its 0.5x is half of these): the
# SmolLM2 server with one HTTP process is bound by that process (0.24 of offline), not by
# its steps, so its 0.5x is a third of what the steps alone would allow.
MEASURED_SATURATION = {"llama3-8b": 43.75, "smollm2": 207.30}
BUDGET = 8192  # max_num_batched_tokens on CUDA
GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # model_runner.PREFILL_GRAPH_TOKENS


def padded(tokens: int) -> int:
    return GRAPH_TOKENS[min(bisect.bisect_left(GRAPH_TOKENS, tokens), len(GRAPH_TOKENS) - 1)]


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


def simulate(shape: str, rate: float, cap: int, max_waiting: int, seed: int,
             mode: str = "total", lift: int = 0, lift_max_waiting: int = 64,
             stats: dict | None = None) -> tuple[float, list, list, int]:
    """Returns (duration ms, inter-token gaps ms, TTFTs ms, steps with prompt tokens).
    ``lift`` > 0: above ``max_waiting`` waiting, steps of at most ``lift`` tokens
    (rows included) while at most ``lift_max_waiting`` wait, the whole budget beyond
    (EngineConfig.mixed_prefill_lift_tokens; ``total`` mode). ``stats`` gets the
    longest queue, the lifted steps and the largest step's tokens."""
    costs, n, median, out_tokens, max_seqs = SHAPES[shape]
    (a, b, c), m = costs[:3], (costs[3] if len(costs) > 3 else 0.0)
    prompts = workload(n, median, seed)
    rng, t, arrivals = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate) * 1e3
    cached: set[int] = set()
    waiting: list[list] = []
    running: list[list] = []  # [request, prompt tokens left, outputs left]
    now, i, done, gaps, ttfts, mixed = 0.0, 0, 0, [], [], 0
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
        prefill = budget
        if stats is not None:
            stats["max_waiting"] = max(stats.get("max_waiting", 0), len(waiting))
        if cap and decodes and len(waiting) <= max_waiting:
            prefill = min(cap, budget) if mode == "prompt" else max(cap - len(decodes), len(decodes) // 2, 1)
        elif cap and decodes and lift and len(waiting) <= lift_max_waiting:
            prefill = max(lift - len(decodes), len(decodes) // 2, 1)
            if stats is not None:
                stats["lifted"] = stats.get("lifted", 0) + 1
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
        if stats is not None:
            stats["max_step"] = max(stats.get("max_step", 0), len(decodes) + tokens)
        step = a + b * len(decodes)
        if tokens:
            step += m + c * (padded(len(decodes) + tokens) - len(decodes))
            mixed += 1
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
    return now, gaps, ttfts, mixed


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--caps", type=int, nargs="+", default=[0, 256, 512])
    p.add_argument("--max-waiting", type=int, nargs="+", default=[8, 1 << 30])
    p.add_argument("--mode", nargs="+", default=["prompt", "total"], choices=["prompt", "total"])
    p.add_argument("--saturation", choices=["measured", "simulated"], default="measured",
                   help="0.5x of the H200 run's saturation rate, or of the simulated one (no cap)")
    p.add_argument("--lift-tokens", type=int, nargs="+", default=[0],
                   help="mixed_prefill_lift_tokens values (0: the whole budget when lifted)")
    p.add_argument("--lift-max-waiting", type=int, default=64)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rate", type=float, default=None, help="the half-load rate in req/s (default: 0.5x saturation)")
    p.add_argument("--costs", default=None, metavar="A,B,C[,M]",
                   help="step costs in ms (decode a + b a row; a step with prompt tokens also m + c a padded "
                        "prompt token) for every shape run")
    args = p.parse_args()
    if args.costs:
        costs = tuple(float(x) for x in args.costs.split(","))
        for shape in args.shapes:
            SHAPES[shape] = (costs,) + SHAPES[shape][1:]
    print(f"{'shape':<10}{'mode':>7}{'cap':>5}{'lifted >':>9}{'lift':>6}{'inf tok/s':>11}{'ITL p50/p99 @0.5x':>20}"
          f"{'p99/p50':>9}{'TTFT p99':>10}{'mixed':>7}{'lifted':>7}{'queue':>6}{'step':>6}")
    for shape in args.shapes:
        _, n, _, out_tokens, _ = SHAPES[shape]
        sat = (MEASURED_SATURATION[shape] if args.saturation == "measured"
               else n / (simulate(shape, math.inf, 0, 0, 0)[0] / 1e3))  # requests/s
        rate = args.rate or 0.5 * sat
        for mode in args.mode:
            for cap in args.caps:
                for max_waiting in (args.max_waiting if cap else [0]):
                    for lift in (args.lift_tokens if cap and mode == "total" else [0]):
                        if not cap and mode != args.mode[0]:
                            continue
                        duration = simulate(shape, math.inf, cap, max_waiting, 0, mode, lift, args.lift_max_waiting)[0]
                        gaps, ttfts, mixed, stats = [], [], 0, {}
                        for seed in range(args.seeds):
                            _, g, t, m = simulate(shape, rate, cap, max_waiting, seed, mode, lift,
                                                  args.lift_max_waiting, stats)
                            gaps, ttfts, mixed = gaps + g, ttfts + t, mixed + m
                        p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
                        lifted = "-" if not cap else ("never" if max_waiting >= 1 << 30 else str(max_waiting))
                        print(f"{shape:<10}{mode if cap else '-':>7}{cap:>5}{lifted:>9}{lift or '-':>6}"
                              f"{n * out_tokens / (duration / 1e3):>11.0f}{p50:>13.2f}/{p99:<6.2f}{p99 / p50:>9.2f}"
                              f"{percentile(ttfts, 99):>10.1f}{mixed / args.seeds:>7.0f}"
                              f"{stats.get('lifted', 0) / args.seeds:>7.0f}{stats.get('max_waiting', 0):>6}"
                              f"{stats.get('max_step', 0):>6}")


if __name__ == "__main__":
    main()
