#!/usr/bin/env python3
"""KV-cache memory: paging against reserving max_model_len per request, same engine.

One pagedcore.Engine per mode over the same fixed block pool and the same seeded
lognormal workload, every request submitted at once: ``paged`` (blocks taken as
tokens arrive) and ``reserve`` (``reserve_max_model_len=True``: a request is
admitted only when every running one could grow to max_model_len, as a server
that pre-allocates each request's whole context would). The engine runs alone:
sampled tokens are random ids and no model runs, because what is measured, the
blocks held and the requests admitted at each step, depends on lengths only, not
on the model or the device. Per step it records the running requests, the blocks
reserved (held by paging; max_model_len's worth per request when reserving) and
the tokens whose KV is held; prints the most requests held at once and the
fraction of reserved slots holding live tokens, and plots blocks over steps.

Usage: python bench/bench_memory.py [--requests 512] [--plot bench/memory_blocks.png]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import pagedcore


def workload(n: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs: lognormal, means about 400 and 250."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(300), 0.8, n), 8, max_model_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(180), 0.8, n), 4, None).astype(int)
    outputs = np.minimum(outputs, max_model_len - prompts)
    return list(zip(prompts.tolist(), outputs.tolist()))


def run(mode: str, reqs: list[tuple[int, int]], args: argparse.Namespace) -> dict:
    engine = pagedcore.Engine(
        num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=False, reserve_max_model_len=mode == "reserve",
    )
    rng = np.random.default_rng(args.seed + 1)
    for i, (p, o) in enumerate(reqs):
        prompt = rng.integers(1, 32000, p).astype(np.int32)
        engine.add_request(f"r{i}", prompt, pagedcore.RequestParams(max_tokens=o, ignore_eos=True))
    steps, running, reserved, held, kv_tokens = [], [], [], [], []
    start = time.perf_counter()
    while engine.stats().num_requests:
        batch = engine.schedule()
        engine.update(rng.integers(1, 32000, batch.num_samples).astype(np.int32))
        s = engine.stats()
        steps.append(s.num_steps)
        running.append(s.num_running_seqs)
        reserved.append(s.num_reserved_blocks)
        held.append(s.num_used_blocks)
        kv_tokens.append(s.num_kv_tokens)
    elapsed = time.perf_counter() - start
    reserved_slots = np.array(reserved, dtype=np.float64) * args.block_size
    busy = reserved_slots > 0
    return {
        "mode": mode, "steps": np.array(steps), "running": np.array(running),
        "reserved": np.array(reserved), "held": np.array(held),
        "peak_running": int(max(running)), "num_steps": len(steps),
        "slot_use": float(np.sum(np.array(kv_tokens)[busy]) / np.sum(reserved_slots[busy])),
        "preemptions": engine.stats().num_preemptions, "seconds": elapsed,
    }


def drive(engine: pagedcore.Engine, rng: np.random.Generator) -> int:
    """Steps the engine to the end with random tokens; returns the peak blocks held."""
    peak = 0
    while engine.stats().num_requests:
        batch = engine.schedule()
        engine.update(rng.integers(1, 32000, batch.num_samples).astype(np.int32))
        peak = max(peak, engine.stats().num_used_blocks)
    return peak


def shared_prefix(args: argparse.Namespace) -> dict:
    """256 requests behind one 1,000-token system prompt, prefix caching on and off."""
    rng = np.random.default_rng(args.seed + 2)
    system = rng.integers(1, 32000, 1000).astype(np.int32)
    tails = [rng.integers(1, 32000, int(n)).astype(np.int32) for n in rng.integers(20, 200, 256)]
    out = {}
    for caching in (True, False):
        engine = pagedcore.Engine(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                                  enable_prefix_caching=caching)
        for i, tail in enumerate(tails):
            engine.add_request(f"r{i}", np.concatenate([system, tail]), pagedcore.RequestParams(max_tokens=64, ignore_eos=True))
        drive(engine, rng)
        s = engine.stats()
        out[caching] = (s.prefix_cache_hit_rate, s.num_steps, s.prefix_cache_hits)
    return out


def parallel_sampling(args: argparse.Namespace) -> tuple[int, int]:
    """Peak blocks: 32 prompts with n=8 against the same 256 samples as independent requests."""
    rng = np.random.default_rng(args.seed + 3)
    prompts = [rng.integers(1, 32000, int(n)).astype(np.int32) for n in rng.integers(200, 600, 32)]
    peaks = []
    for n in (8, 1):
        # A pool large enough that neither run is ever short of blocks.
        engine = pagedcore.Engine(num_blocks=4 * args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                                  enable_prefix_caching=False)
        for i, p in enumerate(prompts):
            for j in range(8 // n):
                engine.add_request(f"r{i}-{j}", p, pagedcore.RequestParams(n=n, max_tokens=128, ignore_eos=True))
        peaks.append(drive(engine, rng))
    return peaks[0], peaks[1]


def plot(results: list[dict], args: argparse.Namespace) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine's Python has no matplotlib: figures only
        print("(matplotlib is not installed: no plot)")
        args.plot = "(none)"
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    for r, colour in zip(results, ("tab:blue", "tab:orange")):
        label = ("paging: blocks held" if r["mode"] == "paged"
                 else "reserving max_model_len: blocks reserved")
        ax.plot(r["steps"], r["reserved"], color=colour, label=f"{label} (peak {r['peak_running']} requests)")
        if r["mode"] == "reserve":
            ax.plot(r["steps"], r["held"], color=colour, linestyle=":", label="  of which holding tokens")
    ax.axhline(args.num_blocks, color="grey", linestyle="--", linewidth=1, label=f"pool: {args.num_blocks} blocks")
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"KV blocks ({args.block_size} tokens)")
    ax.set_title(f"{args.requests} requests at once, lognormal lengths, max_model_len {args.max_model_len}")
    ax.legend(loc="center right", fontsize=8)
    ax.set_ylim(0, args.num_blocks * 1.15)
    fig.tight_layout()
    fig.savefig(args.plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="bench/memory_blocks.png")
    args = parser.parse_args()
    pagedcore._C.set_log_sink(lambda level, message: None)  # preemption warnings: counted below instead
    reqs = workload(args.requests, args.max_model_len, args.seed)
    prompts, outputs = np.array(reqs).T
    results = [run("paged", reqs, args), run("reserve", reqs, args)]
    plot(results, args)
    paged, reserve = results
    print(f"{args.requests} requests, prompt mean {prompts.mean():.0f} (max {prompts.max()}), output mean "
          f"{outputs.mean():.0f}; pool {args.num_blocks} blocks x {args.block_size} tokens; "
          f"max_model_len {args.max_model_len}; max_num_seqs {args.max_num_seqs}; seed {args.seed}")
    print(f"{'mode':<10}{'peak requests':>15}{'slots live':>12}{'steps':>8}{'preemptions':>13}")
    for r in results:
        print(f"{r['mode']:<10}{r['peak_running']:>15}{r['slot_use']:>11.1%}{r['num_steps']:>8}{r['preemptions']:>13}")
    print(f"paging holds {paged['peak_running'] / reserve['peak_running']:.2f}x the requests at once "
          f"(target >= 3x), {paged['slot_use']:.1%} of its slots live (target >= 95%); plot: {args.plot}")
    sp = shared_prefix(args)
    print(f"shared 1,000-token prefix, 256 requests: prefix-cache hit rate {sp[True][0]:.1%} "
          f"({sp[True][2]} prompt tokens not recomputed); steps {sp[True][1]} with caching, {sp[False][1]} without")
    n8, independent = parallel_sampling(args)
    print(f"n=8 on 32 prompts (lengths 200-600, 128 outputs, pool {4 * args.num_blocks} blocks): peak {n8} blocks, "
          f"against {independent} for the same samples as independent "
          f"requests ({independent / n8:.2f}x; copy-on-write shares the prompt blocks)")


if __name__ == "__main__":
    main()
