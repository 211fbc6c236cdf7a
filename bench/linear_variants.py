#!/usr/bin/env python3
"""The 2-16-row product kernel against cuBLAS (issue 11: batch 16 within 15% of batch 1): each
product of the decode step at 2, 8 and 16 rows, timed as CUDA-graph replays (median us) over
copies of the weight that together exceed the L2 cache, so that every call reads the weight
from DRAM as a model's layers do; the gate_up product with SiLU-mul fused against cuBLAS +
``silu_and_mul``. VARIANTS holds environment settings read at each launch (i.e. at capture)
for kernel variants to compare; the last column is the weight's size.

Usage: python3 bench/linear_variants.py [--rows 2,8,16]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from pagedcore import ops

from bench_kernels_gpu import time_graph

SHAPES = {  # name: (in_features, out_features)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "SmolLM2 qkv": (576, 960), "SmolLM2 gate_up": (576, 3072), "SmolLM2 down": (1536, 576),
}
# NOTE: a variant with two rounds of weight loads in flight per warp lost to the default at
# every shape on the H200 (8B gate_up at 16 rows 84.1 against 64.3 us), and was removed.
# NOTE: measured on the H200 on 2026-12-03 (bench/RESULTS.md, thirteenth session): the
# old kernel's warp place from shifts but one warp summing a group's partials ("shift")
# lost to the default's shared sums everywhere SmolLM2's products run (16 rows: qkv 3.0
# against 1.9 us); it was removed.
VARIANTS = (("default", {}), ("old", {"PAGEDCORE_LINEAR_MMA": "old"}))


def timed(fn, env: dict, iters: int) -> float:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return time_graph(fn, iters=iters)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2,8,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    names = [n for n, _ in VARIANTS]
    print("us per call")
    print(f"{'product':<28}{'M':>3}" + "".join(f"{n:>10}" for n in names) + f"{'cuBLAS':>10}{'MB':>8}")
    for name, (k, n) in SHAPES.items():
        copies = max(1, -(-(128 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5 for _ in range(copies)]
        mb = n * k * 2 / 1e6
        iters = max(20, copies)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            gated = torch.empty(rows, n // 2, dtype=torch.bfloat16, device="cuda")
            calls = [0]

            def ours():
                ops.linear(x, weights[calls[0] % copies], out=out)
                calls[0] += 1

            def ours_gated():
                ops.linear_silu_and_mul(x, weights[calls[0] % copies], out=gated)
                calls[0] += 1

            def cublas():
                F.linear(x, weights[calls[0] % copies], out=out)
                calls[0] += 1

            def cublas_gated():
                ops.silu_and_mul(F.linear(x, weights[calls[0] % copies]))
                calls[0] += 1

            mine = [timed(ours, env, iters) for _, env in VARIANTS]
            print(f"{name:<28}{rows:>3}" + "".join(f"{t:10.1f}" for t in mine) + f"{timed(cublas, {}, iters):10.1f}"
                  f"{mb:8.1f}")
            if "gate_up" in name:
                mine = [timed(ours_gated, env, iters) for _, env in VARIANTS]
                print(f"{name + ' + SiLU-mul':<28}{rows:>3}" + "".join(f"{t:10.1f}" for t in mine)
                      + f"{timed(cublas_gated, {}, iters):10.1f}{mb:8.1f}")
        del weights


if __name__ == "__main__":
    with ops.unchecked_indices():
        main()
