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


def plot(results: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

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


if __name__ == "__main__":
    main()
