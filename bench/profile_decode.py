#!/usr/bin/env python3
"""Decode attention cases of issue 13 (and the SmolLM2 shape's 16-row products) run twice
each through pagedcore.ops, for Nsight Compute to profile one launch of each. Each case
prints its name first, so that the report's kernels (in launch order) can be told apart.

Usage: ncu --kernel-name regex:"mma_attention|linear" python3 bench/profile_decode.py [--linear]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pagedcore import ops

# (name, batch, keys, heads, kv heads, head dim, fp8, graph plan length or 0)
CASES = (
    ("8B B=1 L=256", 1, 256, 32, 8, 128, False, 0),
    ("8B B=1 L=4k", 1, 4096, 32, 8, 128, False, 0),
    ("8B B=64 L=4k", 64, 4096, 32, 8, 128, False, 0),
    ("8B B=64 L=4k fp8", 64, 4096, 32, 8, 128, True, 0),
    ("SmolLM2 B=64 L=1k", 64, 1024, 9, 3, 64, False, 0),
    ("SmolLM2 B=16 L=160 graph plan", 16, 160, 9, 3, 64, False, 8192),
    ("8B B=1 L=160 graph plan", 1, 160, 32, 8, 128, False, 8192),
)


def decode(name, batch, ctx, heads, kv_heads, hd, fp8, plan_len, bs=16) -> None:
    per_seq = -(-ctx // bs)
    kc = torch.randn((batch * per_seq + 1, bs, kv_heads, hd), device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    tables = (torch.randperm(batch * per_seq, device="cuda").to(torch.int32) + 1).view(batch, per_seq)
    q = torch.randn((batch, heads, hd), device="cuda", dtype=torch.bfloat16)
    qsl_np = np.arange(batch + 1, dtype=np.int32)
    if plan_len:
        plan = ops.plan_decode(batch, kv_heads, torch.device("cuda"), plan_len)
    else:
        plan = ops.plan_attention(qsl_np, np.full(batch, ctx), heads, kv_heads, torch.device("cuda"), hd,
                                  torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.from_numpy(qsl_np).cuda()
    print(f"case {name}: splits {plan.decode_splits}", flush=True)
    for _ in range(2):
        ops.paged_attention(q, kc, vc, tables, lens, qsl, scale=hd**-0.5, plan=plan)
    torch.cuda.synchronize()


def linear16() -> None:
    for name, (k, n) in (("qkv", (576, 960)), ("o", (576, 576)), ("gate_up", (576, 3072)), ("down", (1536, 576))):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        print(f"case SmolLM2 {name} M=16", flush=True)
        for _ in range(2):
            ops.linear(x, w)
        torch.cuda.synchronize()


def main() -> None:
    torch.manual_seed(0)
    with ops.unchecked_indices():
        for case in CASES:
            decode(*case)
        if "--linear" in sys.argv[1:]:
            linear16()


if __name__ == "__main__":
    main()
