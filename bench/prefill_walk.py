#!/usr/bin/env python3
"""The persistent wgmma-tma prefill kernel's walk over its items, from the plan's end
(PAGEDCORE_PREFILL_WALK=end, the default until 068f05e) against from its start (the
default since: the plan lists tiles longest first, so the long items go first and the
short ones fill the tail), on check_wgmma.py's prefill cases.

Each setting's CUDA graph is captured under its environment (the host reads it per
launch), checked against the other's output (the same items, in another order: the
same result, bit for bit), then the graphs are replayed in alternation, ROUNDS times,
so that the GPU's drift falls on both alike. Prints median microseconds, TFLOP/s,
and the model's prediction: the busiest CTA's share of key tiles over the mean
(132 CTAs, an item costing its key tiles + 1).

Usage: python3 bench/prefill_walk.py
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from pagedcore import ops
from pagedcore.ops import planning

from bench_kernels_gpu import graph_of, replay_us, warm
from check_wgmma import FP8_CASES, ISSUE_CASES, build, flops, scales
from decode_variants import Settings

SETTINGS = (("end", {"PAGEDCORE_PREFILL_WALK": "end"}), ("start", {"PAGEDCORE_PREFILL_WALK": "start"}))
ROUNDS = 5
ITERS = 5


def modelled_spread(case, sms: int) -> dict[str, float]:
    """The busiest CTA's work over the mean, per walk (a model: an item costs its
    128-key tiles + 1; kv head fastest in the linear order, as the kernel's grid)."""
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in case.rows])])
    lens = np.array([c for _, c in case.rows])
    ws, wq, tile, *_ = planning._plan_lists(qsl, lens, case.heads, case.kv_heads, case.head_dim, case.dtype)
    q_lens = np.diff(qsl)
    keys = lens[ws] - q_lens[ws] + np.minimum(wq + tile, q_lens[ws])
    cost = np.repeat(np.ceil(keys / 128) + 1, case.kv_heads)
    total, g = cost.shape[0], min(sms, cost.shape[0])
    out = {}
    for name in ("end", "start"):
        load = np.zeros(g)
        for pos in range(total):
            r, k = divmod(pos, g)
            cta = g - 1 - k if r % 2 else k
            load[cta] += cost[pos if name == "start" else total - 1 - pos]
        out[name] = float(load.max() / load.mean())
    return out


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; walk from the plan's end against from its start (the default)")
    print(f"{'case':<42}{'end us':>9}{'start us':>10}{'start/end':>10}{'TFLOP/s':>9}  model max/mean end, start")
    for case in ISSUE_CASES + FP8_CASES:
        if case.head_dim != 128:  # (head dim 64 runs mma.sync: no persistent walk)
            continue
        q, kc, vc, tables, seq_lens, qsl, qsl_np, seq_np = build(case)
        plan = ops.plan_attention(qsl_np, seq_np, case.heads, case.kv_heads, torch.device("cuda"), case.head_dim,
                                  case.dtype)
        graphs, outs = [], []
        for _, env in SETTINGS:
            out = torch.full_like(q, float("nan"))

            def call(out=out):
                ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=case.head_dim**-0.5, out=out, plan=plan,
                                    **scales(case))

            with Settings(env):  # (the walk is read when the graph's launches are captured)
                call()
                graphs.append(graph_of(call, ITERS))
            outs.append(out)
        torch.cuda.synchronize()
        same = torch.equal(outs[0], outs[1])
        samples = [[] for _ in SETTINGS]
        for _ in range(ROUNDS):
            for i, graph in enumerate(graphs):
                warm(graph, 20.0)
                samples[i] += replay_us(graph, ITERS, 3)
        us = [statistics.median(s) for s in samples]
        spread = modelled_spread(case, sms)
        print(f"{case.name:<42}{us[0]:9.1f}{us[1]:10.1f}{us[1] / us[0]:10.3f}{flops(case) / us[1] / 1e6:9.0f}  "
              f"{spread['end']:.3f}, {spread['start']:.3f}{'' if same else '  OUTPUTS DIFFER'}")


if __name__ == "__main__":
    main()
