#!/usr/bin/env python3
"""Decode attention cases of issue 13 (and the SmolLM2 shape's 16-row products) run twice
each through pagedcore.ops, for Nsight Compute to profile one launch of each. Each case
prints its name first, so that the report's kernels (in launch order) can be told apart.

With --peers, B=64 L=4k also runs through SDPA on the same keys gathered contiguously
(cuDNN's kernel on the H200) and FlashInfer's tensor-core decode on the same paged cache,
when flashinfer is installed: the kernels our decode kernel is measured against.

Usage: ncu --kernel-name regex:"mma_attention|linear|flash|Batch" python3 bench/profile_decode.py [--linear] [--peers]
(ncu matches a kernel's base name: SDPA's cuDNN kernel holds "flash", FlashInfer's decode is
BatchPrefillWithPagedKVCacheKernel.)

What the fifteenth session looked at (bench/RESULTS.md): --clock-control none --metrics
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,
lts__t_sector_hit_rate.pct (L2 sectors asked for against the 33.55M that B=64 L=4k needs).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedcore import ops

from bench_kernels_gpu import contiguous_kv, flashinfer_wrapper
from decode_variants import build, picked

# (name, batch, keys, heads, kv heads, head dim, fp8, graph plan length or 0)
CASES = (
    ("8B B=1 L=256", 1, 256, 32, 8, 128, False, 0),
    ("8B B=1 L=4k", 1, 4096, 32, 8, 128, False, 0),
    ("8B B=64 L=4k", 64, 4096, 32, 8, 128, False, 0),
    ("8B B=64 L=4k fp8", 64, 4096, 32, 8, 128, True, 0),
    ("SmolLM2 B=64 L=1k", 64, 1024, 9, 3, 64, False, 0),
    ("SmolLM2 B=16 L=160 graph plan", 16, 160, 9, 3, 64, False, 8192),
    ("8B B=1 L=160 graph plan", 1, 160, 32, 8, 128, False, 8192),
    ("8B B=16 L=256 graph plan", 16, 256, 32, 8, 128, False, 8192),
)


def decode(name, batch, ctx, heads, kv_heads, hd, fp8, plan_len, bs=16) -> None:
    q, kc, vc, tables, lens, qsl, plan = build(batch, ctx, heads, kv_heads, hd, fp8, plan_len, bs=bs)
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


def peers(batch=64, ctx=4096, heads=32, kv_heads=8, hd=128, bs=16) -> None:
    """SDPA on the keys gathered contiguously, then FlashInfer on the paged cache, twice each."""
    q, kc, vc, tables, _, _, _ = build(batch, ctx, heads, kv_heads, hd, False, 0, bs=bs)
    k, v = contiguous_kv(kc, vc, tables, ctx, kc.dtype)
    print(f"case SDPA contiguous B={batch} L={ctx}", flush=True)
    for _ in range(2):
        F.scaled_dot_product_attention(q.view(batch, heads, 1, hd), k, v, enable_gqa=True, scale=hd**-0.5)
    torch.cuda.synchronize()
    try:
        import flashinfer
    except ImportError:
        print("FlashInfer: not installed (bench/fetch_peer_wheels.sh, carry .peers)", flush=True)
        return
    wrapper = flashinfer_wrapper(flashinfer, q, kc, tables, ctx, bs)
    print(f"case FlashInfer NHD B={batch} L={ctx}", flush=True)
    for _ in range(2):
        wrapper.run(q, (kc, vc))
    torch.cuda.synchronize()


def main() -> None:
    torch.manual_seed(0)
    with ops.unchecked_indices():
        for case in picked(CASES, "DECODE_CASES"):
            decode(*case)
        if "--linear" in sys.argv[1:]:
            linear16()
    if "--peers" in sys.argv[1:]:
        peers()


if __name__ == "__main__":
    main()
