#!/usr/bin/env python3
"""One decode step (B=64, L=4k, 32/8 heads, d128, block 16, bf16) and one 8k-token
prefill through pagedcore.ops, for a profiler (Nsight Compute) to look at.

With ``--short``: one batch-1 decode row of 160 keys instead (the 8B shape's
batch-1 decode step), planned as the model's decode graphs plan it.

Usage: ncu --kernel-name regex:mma_attention python3 bench/profile_attention.py [--short]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pagedcore import ops


def main() -> None:
    torch.manual_seed(0)
    dtype, heads, kv_heads, hd, bs = torch.bfloat16, 32, 8, 128, 16
    short = "--short" in sys.argv[1:]
    for batch, ctx, q_len in ((1, 160, 1),) if short else ((64, 4096, 1), (1, 8192, 8192)):
        per_seq = -(-ctx // bs)
        kc = torch.randn((batch * per_seq + 1, bs, kv_heads, hd), device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        tables = (torch.randperm(batch * per_seq, device="cuda").to(torch.int32) + 1).view(batch, per_seq)
        q = torch.randn((batch * q_len, heads, hd), device="cuda", dtype=dtype)
        qsl_np = np.arange(batch + 1, dtype=np.int32) * q_len
        if short:
            plan = ops.plan_decode(batch, kv_heads, torch.device("cuda"), 4096)
        else:
            plan = ops.plan_attention(qsl_np, np.full(batch, ctx), heads, kv_heads, torch.device("cuda"), hd, dtype)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.from_numpy(qsl_np).cuda()
        for _ in range(3):
            ops.paged_attention(q, kc, vc, tables, lens, qsl, scale=hd**-0.5, plan=plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
