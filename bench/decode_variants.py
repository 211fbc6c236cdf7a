#!/usr/bin/env python3
"""The decode attention kernel's variants side by side (issue 13): each case timed (CUDA-graph
replays, median us) under each setting of the environment switches the kernel reads at launch,
with its error against SDPA on the same keys gathered contiguously. The variants of a case
share one set of tensors, and their graphs are replayed in turn, five rounds.

  PAGEDCORE_DECODE_DEEP_CTAS  decode launches of at most this many CTAs keep more tiles in
                              flight (default one per SM; 0: never, 100000: always)
  PAGEDCORE_FP8_FAST_CVT      fp8 widened by integer operations (1, default) or cvt (0)
  PAGEDCORE_DECODE_EARLY_META lengths and first block ids read before the PDL wait (1, the
                              default over 16-bit caches; 0 off), and the first tiles' K/V rows
                              prefetched into L2 there too (2)
  PAGEDCORE_FP8_WIDE_TILES    fp8 launches that are not deep: 128-key tiles (1, default; 0: 64)
  PAGEDCORE_DECODE_ONE_WAVE   decode key splits planned for one CTA an SM where that fills
                              >= 80% of them, so that the launch is deep (1, default); two
                              CTAs an SM throughout (0)
  PAGEDCORE_DECODE_BALANCE    launches of one to 1.5 CTAs an SM split in two, so that no SM
                              runs two whole rows' CTAs (1), or not split (0, default)
  PAGEDCORE_DECODE_WIDE_D64   16-bit caches at head dim 64: 128-key tiles, two stages, swizzled
                              rows (1, default), or 64-key tiles, three stages, padded rows (0)
  PAGEDCORE_FP8_CVT_MIX       fp8 128-key tiles: K widened by the cvt unit, V by integer
                              operations (1, default), both by integer operations (0), or
                              both by the cvt unit (2)
  PAGEDCORE_DECODE_KEYS_IN_M  decode warps with keys as the mma's rows and the query vectors
                              as its columns (1; bf16 queries, head dims 64 and 128)
  PAGEDCORE_DECODE_TMA        fp8 at head dim 128 with keys in M (not deep): K/V tiles by bulk
                              tensor copies, one per cache block (1, default on Hopper), or by
                              cp.async (0)
  PAGEDCORE_DECODE_TMA_L2     those TMA boxes' L2 promotion in bytes (128, default; 0, 64,
                              256; the wgmma kernel's default 256)
  PAGEDCORE_DECODE_TMA_SPREAD those TMA boxes issued by every warp (1, default) or by warp 0 (0;
                              behind each tile's barrier)
  PAGEDCORE_DECODE_TMA_SKEW   every warp's boxes without each tile's barrier, a stage refilled
                              once every warp arrived on its empty mbarrier (1, default), or
                              behind each tile's barrier (0)
  PAGEDCORE_DECODE_TMA_LEAN   the skew's tiles with fewer instructions for the same arithmetic
                              (1, default: K's high bytes widened without a shift, the mask
                              only on tiles that are not whole, the rows' maxima reduced only
                              when one rises, and a kernel of one column tile and no softcap
                              where the plan has no decode row of more than 8 vectors: not a
                              mixed graph's padded plan, so the "mixed" cases run wide), or the
                              kernel before them (0)
  PAGEDCORE_DECODE_TMA_KT64    the narrow lean kernel (where it runs, block sizes up to 64) in
                              64-key tiles, four CTAs an SM (1, default), or 128-key tiles,
                              two an SM (0)
  PAGEDCORE_DECODE_CLUSTER    rows under 512 keys, and split rows of at most
                              C x PAGEDCORE_DECODE_CLUSTER_KEYS keys (default 128), shared by
                              clusters of C = 4 or 8 CTAs, merged through distributed shared
                              memory, in deep launches over 16-bit caches that fit one wave with
                              them and whose clusters fit the GPU at once (0: off; unset: the
                              plan's, 4 where the longest row has 128 keys or more);
                              PAGEDCORE_DECODE_CLUSTER_ASYNC=0: the merge's stores behind a
                              cluster barrier (default: by st.async);
                              PAGEDCORE_DECODE_CLUSTER_MIN_KEYS=K: rows under K keys run by
                              their cluster's first CTA alone (128, default; 0: none)
  PAGEDCORE_MIXED_DECODE_SPARE the "mixed graph" cases' decode items past the step's rows:
                              spare, their CTAs returning at once (1, default), or each
                              computing the padding row over one key (0)
  PAGEDCORE_ATTN_PAD          staged K/V rows swizzled (0, default over 16-bit caches at head
                              dim 128: each 32-byte sector of the cache lands whole in shared
                              memory) or padded by 16 bytes (16, as elsewhere but head dim
                              64's 128-key tiles, always swizzled)

After the table, FlashInfer's tensor-core decode on B=64 L=4k with the cache in its NHD
layout (ours) and in HND (head-major blocks), when flashinfer is installed.

Usage: [DECODE_CASES=name,...] [DECODE_VARIANTS=name,...] [DECODE_BLOCK_SIZE=16] python3 bench/decode_variants.py
(each a comma-separated list of pieces of the names to run; all without it; the cache's block
size, 16 without it)
"""

from __future__ import annotations

import os
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from pagedcore import ops

from bench_kernels_gpu import contiguous_kv, flashinfer_decode, graph_of, replay_us

VARIANTS = (
    ("default", {}),
    ("deep off", {"PAGEDCORE_DECODE_DEEP_CTAS": "0"}),
    ("deep always", {"PAGEDCORE_DECODE_DEEP_CTAS": "100000"}),
    ("fp8 cvt", {"PAGEDCORE_FP8_FAST_CVT": "0"}),
    ("early off", {"PAGEDCORE_DECODE_EARLY_META": "0"}),
    ("early + L2", {"PAGEDCORE_DECODE_EARLY_META": "2"}),
    ("fp8 narrow", {"PAGEDCORE_FP8_WIDE_TILES": "0"}),
    ("two an SM", {"PAGEDCORE_DECODE_ONE_WAVE": "0"}),
    ("padded", {"PAGEDCORE_ATTN_PAD": "16"}),
    ("balanced", {"PAGEDCORE_DECODE_BALANCE": "1"}),
    ("d64 narrow", {"PAGEDCORE_DECODE_WIDE_D64": "0"}),
    ("d64 narrow balanced", {"PAGEDCORE_DECODE_WIDE_D64": "0", "PAGEDCORE_DECODE_BALANCE": "1"}),
    ("fp8 int", {"PAGEDCORE_FP8_CVT_MIX": "0"}),
    ("fp8 all cvt", {"PAGEDCORE_FP8_CVT_MIX": "2"}),
    ("keys in M", {"PAGEDCORE_DECODE_KEYS_IN_M": "1"}),
    ("keys in M off", {"PAGEDCORE_DECODE_KEYS_IN_M": "0"}),
    ("two-pass merge", {"PAGEDCORE_DECODE_MERGE": "0"}),
    ("split chunk 256", {"PAGEDCORE_DECODE_SPLIT_KEYS": "256"}),
    ("keys in M, fp8 all cvt", {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_FP8_CVT_MIX": "2"}),
    ("keys in M, fp8 int", {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_FP8_CVT_MIX": "0"}),
    ("tma off", {"PAGEDCORE_DECODE_TMA": "0"}),
    ("fp8 wgmma", {"PAGEDCORE_DECODE_WGMMA": "1"}),
    ("tma L2 none", {"PAGEDCORE_DECODE_TMA_L2": "0"}),
    ("tma L2 256B", {"PAGEDCORE_DECODE_TMA_L2": "256"}),
    ("tma warp 0 issue", {"PAGEDCORE_DECODE_TMA_SPREAD": "0"}),
    ("tma tile barrier", {"PAGEDCORE_DECODE_TMA_SKEW": "0"}),
    ("lean off", {"PAGEDCORE_DECODE_TMA_LEAN": "0"}),
    ("tma 128-key tiles", {"PAGEDCORE_DECODE_TMA_KT64": "0"}),
    ("cluster off", {"PAGEDCORE_DECODE_CLUSTER": "0"}),
    ("cluster 4 barrier", {"PAGEDCORE_DECODE_CLUSTER": "4", "PAGEDCORE_DECODE_CLUSTER_ASYNC": "0"}),
    ("cluster 8 barrier", {"PAGEDCORE_DECODE_CLUSTER": "8", "PAGEDCORE_DECODE_CLUSTER_ASYNC": "0"}),
    ("cluster 4 async", {"PAGEDCORE_DECODE_CLUSTER": "4", "PAGEDCORE_DECODE_CLUSTER_ASYNC": "1"}),
    ("cluster 8 async", {"PAGEDCORE_DECODE_CLUSTER": "8", "PAGEDCORE_DECODE_CLUSTER_ASYNC": "1"}),
    ("cluster min 0 keys", {"PAGEDCORE_DECODE_CLUSTER_MIN_KEYS": "0"}),
    ("no spare items", {"PAGEDCORE_MIXED_DECODE_SPARE": "0"}),
    ("padded tiles", {"PAGEDCORE_MIXED_TILE_SPARE": "0"}),
    ("cluster 8 unsplit rows", {"PAGEDCORE_DECODE_CLUSTER": "8", "PAGEDCORE_DECODE_CLUSTER_KEYS": "0"}),
    ("cluster 8 to 2k keys", {"PAGEDCORE_DECODE_CLUSTER": "8", "PAGEDCORE_DECODE_CLUSTER_KEYS": "256"}),
)
# (name, batch, keys, heads, kv heads, head dim, fp8, graph plan length or 0[, mixed graph
# tokens: the plan of the whole mixed graph of that many tokens, ops.planning.PaddedPlan,
# its rows min(256, tokens) + a padding row, the step's rows all decode rows])
CASES = (
    ("B=1 L=16", 1, 16, 32, 8, 128, False, 0),
    ("B=1 L=128", 1, 128, 32, 8, 128, False, 0),
    ("B=1 L=256", 1, 256, 32, 8, 128, False, 0),
    ("B=1 L=400", 1, 400, 32, 8, 128, False, 0),
    ("B=1 L=512", 1, 512, 32, 8, 128, False, 0),
    ("B=1 L=1k", 1, 1024, 32, 8, 128, False, 0),
    ("B=1 L=4k", 1, 4096, 32, 8, 128, False, 0),
    ("B=1 L=32k", 1, 32768, 32, 8, 128, False, 0),
    ("B=64 L=1k", 64, 1024, 32, 8, 128, False, 0),
    ("B=64 L=4k", 64, 4096, 32, 8, 128, False, 0),
    ("SmolLM2 B=64 L=1k", 64, 1024, 9, 3, 64, False, 0),
    ("fp8 B=64 L=4k", 64, 4096, 32, 8, 128, True, 0),
    ("fp8 B=1 L=4k", 1, 4096, 32, 8, 128, True, 0),
    ("fp8 B=64 L=1k", 64, 1024, 32, 8, 128, True, 0),
    ("fp8 B=512 L=4k 4/1", 512, 4096, 4, 1, 128, True, 0),
    ("B=512 L=4k 4/1", 512, 4096, 4, 1, 128, False, 0),
    ("SmolLM2 fp8 B=64 L=1k", 64, 1024, 9, 3, 64, True, 0),
    ("fp8 8B B=16 L=4k graph plan", 16, 4096, 32, 8, 128, True, 8192),
    ("8B B=1 L=160 graph plan", 1, 160, 32, 8, 128, False, 8192),
    ("SmolLM2 B=1 L=32 graph plan", 1, 32, 9, 3, 64, False, 8192),
    ("SmolLM2 B=1 L=160 graph plan", 1, 160, 9, 3, 64, False, 8192),
    ("SmolLM2 B=16 L=160 graph plan", 16, 160, 9, 3, 64, False, 8192),
    ("8B B=16 L=160 graph plan", 16, 160, 32, 8, 128, False, 8192),
    ("8B B=16 L=256 graph plan", 16, 256, 32, 8, 128, False, 8192),
    ("8B B=16 L=384 graph plan", 16, 384, 32, 8, 128, False, 8192),
    ("8B B=16 L=4k graph plan", 16, 4096, 32, 8, 128, False, 8192),
    ("8B B=1 L=32k graph plan", 1, 32768, 32, 8, 128, False, 32768),
    ("8B B=1 L=600 graph plan", 1, 600, 32, 8, 128, False, 8192),
    ("8B B=1 L=1k graph plan", 1, 1024, 32, 8, 128, False, 8192),
    ("SmolLM2 B=1 L=1k graph plan", 1, 1024, 9, 3, 64, False, 8192),
    ("SmolLM2 B=150 L=400 graph plan", 150, 400, 9, 3, 64, False, 8192),
    ("SmolLM2 B=150 L=400 mixed graph 512", 150, 400, 9, 3, 64, False, 8192, 512),
    ("SmolLM2 B=40 L=400 mixed graph 512", 40, 400, 9, 3, 64, False, 8192, 512),
    ("8B B=64 L=400 graph plan", 64, 400, 32, 8, 128, False, 8192),
    ("8B B=64 L=400 mixed graph 512", 64, 400, 32, 8, 128, False, 8192, 512),
)


def build(batch, ctx, heads, kv_heads, hd, fp8, plan_len, mixed=0, bs=16):
    """One decode step's tensors on the GPU: (q, kc, vc, tables, lens, qsl, plan); one
    query a row, every row `ctx` keys in shuffled blocks, the plan (made under the current
    settings) the step's own or, with `plan_len`, the decode graphs' (splits for rows up
    to plan_len). With `mixed`, a padding row after the step's (one query over one key in
    the null block, block 0), as the mixed graphs run it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    per_seq = -(-ctx // bs)
    kc = torch.randn((batch * per_seq + 1, bs, kv_heads, hd), generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    tables = (torch.randperm(batch * per_seq, generator=g, device="cuda").to(torch.int32) + 1).view(batch, per_seq)
    q = torch.randn((batch, heads, hd), generator=g, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    if mixed:
        tables = torch.cat([tables, torch.zeros_like(tables[:1])])
        q = torch.cat([q, torch.randn((1, heads, hd), generator=g, device="cuda", dtype=torch.bfloat16)])
        lens = torch.cat([lens, torch.ones_like(lens[:1])])
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables, lens, qsl, plan_for(batch, ctx, heads, kv_heads, hd, plan_len, mixed)


def plan_for(batch, ctx, heads, kv_heads, hd, plan_len, mixed=0):
    if mixed:
        from pagedcore.model_runner import mixed_graph_tile_rows

        padded = ops.planning.PaddedPlan(mixed, min(256, mixed), mixed_graph_tile_rows(mixed), heads, kv_heads, hd,
                                         torch.bfloat16, torch.device("cuda"), plan_len)
        lens = np.array([ctx] * batch + [1], dtype=np.int32)
        assert padded.fill(np.arange(batch + 2, dtype=np.int32), lens, pad_row=batch)
        padded.upload()
        padded.plan.padded = padded  # (its lists stay alive with the plan)
        return padded.plan
    if plan_len:
        return ops.plan_decode(batch, kv_heads, torch.device("cuda"), plan_len)
    return ops.plan_attention(np.arange(batch + 1, dtype=np.int32), np.full(batch, ctx), heads, kv_heads,
                              torch.device("cuda"), hd, torch.bfloat16)


def reference(q, kc, vc, tables, ctx):
    """SDPA in float32 over the rows' keys gathered contiguously: [batch, heads, 1, hd]."""
    batch, heads, hd = q.shape
    k, v = contiguous_kv(kc, vc, tables, ctx, torch.float32)
    return F.scaled_dot_product_attention(q.float().view(batch, heads, 1, hd), k, v, enable_gqa=True, scale=hd**-0.5)


class Settings:
    """The environment of one variant, set inside `with` (the kernels read it per launch)."""

    def __init__(self, env):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, val in self.saved.items():
            os.environ.pop(k) if val is None else os.environ.__setitem__(k, val)


ROUNDS = 5  # the variants' graphs replayed in turn, so that drift falls on all alike
ITERS = 20  # calls per graph


def time_variants(shape, variants):
    """Per variant: (median us, rel err) on one set of tensors; each variant's plan and
    graph made under its settings, then all graphs replayed in alternation."""
    batch, ctx, heads, kv_heads, hd, fp8, plan_len, *mixed = shape
    mixed = mixed[0] if mixed else 0
    bs = int(os.environ.get("DECODE_BLOCK_SIZE", "") or 16)
    q, kc, vc, tables, lens, qsl, _ = build(batch, ctx, heads, kv_heads, hd, fp8, plan_len, mixed, bs=bs)
    ref = reference(q[:batch], kc, vc, tables[:batch], ctx)
    graphs, errs, calls = [], [], []  # (calls: each graph's plan and output stay alive while it replays)
    for _, env in variants:
        with Settings(env):
            plan = plan_for(batch, ctx, heads, kv_heads, hd, plan_len, mixed)
            out = torch.empty_like(q)
            fn = lambda plan=plan, out=out: ops.paged_attention(q, kc, vc, tables, lens, qsl, scale=hd**-0.5,  # noqa: E731
                                                              out=out, plan=plan)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            errs.append(((out[:batch].float().view_as(ref) - ref).norm() / ref.norm()).item())
            graphs.append(graph_of(fn, ITERS))
            calls.append(fn)
    samples = [[] for _ in variants]
    for _ in range(ROUNDS):
        for i, graph in enumerate(graphs):
            samples[i] += replay_us(graph, ITERS, 3)
    return [statistics.median(t) for t in samples], errs


def picked(rows, env: str):
    """`rows` whose names hold one of the comma-separated pieces of $`env` (all without it)."""
    want = [w for w in os.environ.get(env, "").split(",") if w]
    return [r for r in rows if not want or any(w in r[0] for w in want)]


def main() -> None:
    torch.manual_seed(0)
    global VARIANTS, CASES
    VARIANTS, CASES = picked(VARIANTS, "DECODE_VARIANTS"), picked(CASES, "DECODE_CASES")
    # (each column as wide as its name and two spaces, at least 16: names do not run together)
    first = max([32] + [len(name) + 1 for name, *_ in CASES])
    widths = [max(16, len(name) + 2) for name, _ in VARIANTS]
    print(f"{'case':<{first}}" + "".join(f"{name:>{w}}" for (name, _), w in zip(VARIANTS, widths))
          + "   (us; max rel err)")
    with ops.unchecked_indices():
        for name, *shape in CASES:
            cells, errs = time_variants(shape, VARIANTS)
            print(f"{name:<{first}}" + "".join(f"{c:{w}.1f}" for c, w in zip(cells, widths))
                  + f"   {max(errs):.1e}", flush=True)
    for layout in ("NHD", "HND"):
        print(f"FlashInfer B=64 L=4k {layout}: {flashinfer_peer(64, 4096, 32, 8, 128, layout)}", flush=True)


def flashinfer_peer(batch, ctx, heads, kv_heads, hd, layout, bs=16):
    """FlashInfer's tensor-core paged decode (bench_kernels_gpu.flashinfer_decode) on the
    same keys, the cache in `layout`: "us (rel err)" or why not."""
    q, kc, vc, tables, _, _, _ = build(batch, ctx, heads, kv_heads, hd, False, 0, bs=bs)
    ref = reference(q, kc, vc, tables, ctx)
    if layout == "HND":  # [blocks, kv heads, block size, hd]: a head's rows of a block adjacent
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    us, out = flashinfer_decode(q, kc, vc, tables, ctx, bs, layout)
    if us is None:
        return f"skipped: {out}"
    err = ((out.float().view_as(ref) - ref).norm() / ref.norm()).item()
    return f"{us:.1f} us ({err:.1e})"


if __name__ == "__main__":
    main()
