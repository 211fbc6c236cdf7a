#!/usr/bin/env python3
"""RMSNorm and add+RMSNorm kernel variants (PAGEDCORE_RMSNORM_VECS: vectors of 16 bytes per
thread held in registers, 1 / 2 / 4, read at each launch) at decode and prefill row counts:
median us per call as CUDA-graph replays, the time of the bytes at 4.16 TB/s beside them, and
whether each variant's output has the same bits as K = 1's (the sums of squares run in
another order; they are in double, so they should not differ).

Usage: python3 bench/rmsnorm_variants.py
"""

from __future__ import annotations

import os

import torch

from pagedcore import ops

from bench_kernels_gpu import time_graph

SHAPES = [(1, 4096), (16, 4096), (512, 4096), (4096, 4096), (16, 576), (512, 576), (4096, 576)]
VECS = ("1", "2", "4")
BANDWIDTH = 4.16e12


def run(rows: int, hidden: int, residual: bool, vecs: str, x0: torch.Tensor, r0: torch.Tensor, w: torch.Tensor):
    os.environ["PAGEDCORE_RMSNORM_VECS"] = vecs
    x, r = x0.clone(), r0.clone()
    if residual:
        ops.fused_add_rms_norm(x, r, w, 1e-5)
        out = torch.cat([x, r])
        xt, rt = x0.clone(), r0.clone()
        us = time_graph(lambda: ops.fused_add_rms_norm(xt, rt, w, 1e-5))
    else:
        out = ops.rms_norm(x, w, 1e-5)
        o = torch.empty_like(x)
        us = time_graph(lambda: ops.rms_norm(x0, w, 1e-5, out=o))
    return us, out


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'case':<28}" + "".join(f"{'K=' + v:>9}" for v in VECS) + f"{'bytes us':>10}  same bits as K=1")
    best = {}
    for residual in (True, False):
        for rows, hidden in SHAPES:
            x0 = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
            r0 = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
            w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(torch.bfloat16)
            times, outs = {}, {}
            for v in VECS:
                times[v], outs[v] = run(rows, hidden, residual, v, x0, r0, w)
            moved = rows * hidden * 2 * (4 if residual else 2)
            same = all(torch.equal(outs[v], outs["1"]) for v in VECS)
            name = f"{'add+' if residual else ''}norm {rows} x {hidden}"
            print(f"{name:<28}" + "".join(f"{times[v]:9.1f}" for v in VECS) + f"{moved / BANDWIDTH * 1e6:10.1f}  {same}")
            best[name] = min(VECS, key=times.get)
    os.environ.pop("PAGEDCORE_RMSNORM_VECS", None)
    print("fastest: " + ", ".join(f"{k}: K={v}" for k, v in best.items()))


if __name__ == "__main__":
    main()
