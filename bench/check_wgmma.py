#!/usr/bin/env python3
"""One device call to tell whether the Hopper prefill kernels (wgmma) work and how fast.

Runs pagedcore.ops.paged_attention on a few prefill cases with
PAGEDCORE_PREFILL_KERNEL=mma and each wgmma variant (KERNELS; same plan, same data), against float32 torch
math over the keys gathered from the paged cache (block 0 and every slot past a row's
length hold NaN), and times both beside FlashAttention-2's varlen kernel in torch
(``aten._flash_attention_forward``, causal aligned bottom-right, GQA) on the same keys
laid out contiguously. Prints one line per case and kernel: max abs error, NaN count,
microseconds and TFLOP/s; for a wrong output, where the errors sit.

Usage: python3 bench/check_wgmma.py [--quick] [--iters N]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedcore import _C, ops

from bench_kernels_gpu import time_graph

ENV = "PAGEDCORE_PREFILL_KERNEL"
# wgmma-tma-pairs: one copy per block for both 64-dim halves (d128); wgmma-tma-fp8: the TMA
# kernel over an fp8 e4m3 cache (widened to fp16 in shared memory; auto over 16-bit caches:
# the other names leave fp8 caches on mma.sync, so in the fp8 cases they time mma.sync).
KERNELS = ("mma", "wgmma", "wgmma-tma", "wgmma-tma-pairs", "wgmma-tma-fp8")
PROBE_SECONDS = 90


@dataclass
class Case:
    name: str
    rows: list  # (q_len, seq_len) per row
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    window: int = 0
    softcap: float = 0.0
    fp8: tuple | None = None  # (k_scale, v_scale): the cache in fp8 e4m3 (stored value / scale)


ISSUE_CASES = [
    Case("8k causal (32/8, d128, bs16)", [(8192, 8192)]),
    Case("8k causal (32/8, d128, bs128)", [(8192, 8192)], block_size=128),
    Case("2048 new over 6144 cached (32/8, d128)", [(2048, 8192)]),
    Case("16 x 512 over 1-4k cached (32/8, d128)", [(512, 512 + c) for c in np.linspace(1024, 4096, 16).astype(int)]),
    Case("SmolLM2 16 x 512 (9/3, d64)", [(512, 512)] * 16, heads=9, kv_heads=3, head_dim=64),
]

EXTRA_CASES = [
    Case("mixed rows, group 3, fp16, d64, bs8", [(70, 101), (129, 129), (5, 5), (300, 1000), (1, 40), (17, 17)],
         heads=6, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float16),
    Case("group 1, d128, bs32, prefix", [(200, 700), (128, 128), (255, 300)], heads=4, kv_heads=4, block_size=32),
    Case("key splits: 40 over 5000 (32/8)", [(40, 5000)]),
    Case("window 256 + softcap 30 (32/8, d128)", [(1000, 3000)], window=256, softcap=30.0),
    # (first keys mid-block, for the TMA kernel's block-aligned tiles)
    Case("window 200, bs64, splits (32/8, d128)", [(1000, 3000), (40, 5000)], window=200, block_size=64),
    Case("fp8 cache, window 200, splits (32/8, d128)", [(1000, 3000), (40, 5000), (70, 101)], window=200,
         fp8=(0.5, 2.0)),
]
# The fp8 cache at issue 12's 8k causal shape: wgmma-tma-fp8 against mma.sync over the same
# fp8 cache (the other names) and the bf16 case above.
FP8_CASES = [
    Case("8k causal fp8 cache (32/8, d128, bs16)", [(8192, 8192)], fp8=(0.5, 2.0)),
]

def build(case: Case, seed: int = 0):
    """Paged cache with NaN in block 0 and in every slot past a row's length; rows'
    blocks scattered at random."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs = case.block_size
    per_row = [-(-ctx // bs) for _, ctx in case.rows]
    nb = sum(per_row) + 1
    shape = (nb, bs, case.kv_heads, case.head_dim)
    kc = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(case.dtype)
    vc = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(case.dtype)
    kc[0] = float("nan")
    vc[0] = float("nan")
    perm = (torch.randperm(nb - 1, generator=g, device="cuda") + 1).to(torch.int32)
    width = max(per_row)
    tables = torch.zeros((len(case.rows), width), dtype=torch.int32, device="cuda")
    at = 0
    for r, ((_, ctx), n) in enumerate(zip(case.rows, per_row)):
        tables[r, :n] = perm[at:at + n]
        at += n
        if ctx % bs:
            last = int(tables[r, n - 1])
            kc[last, ctx % bs:] = float("nan")
            vc[last, ctx % bs:] = float("nan")
    total_q = sum(q for q, _ in case.rows)
    q = torch.randn((total_q, case.heads, case.head_dim), generator=g, device="cuda", dtype=torch.float32)
    q = q.to(case.dtype)
    if case.fp8:  # (NaN stays NaN in e4m3)
        kc = (kc.float() / case.fp8[0]).to(torch.float8_e4m3fn)
        vc = (vc.float() / case.fp8[1]).to(torch.float8_e4m3fn)
    qsl_np = np.concatenate([[0], np.cumsum([q_len for q_len, _ in case.rows])]).astype(np.int32)
    seq_np = np.array([ctx for _, ctx in case.rows], dtype=np.int32)
    return q, kc, vc, tables, torch.from_numpy(seq_np).cuda(), torch.from_numpy(qsl_np).cuda(), qsl_np, seq_np


def gather(cache, table_row, ctx):
    bs = cache.shape[1]
    n = -(-ctx // bs)
    return cache[table_row[:n].long()].reshape(n * bs, *cache.shape[2:])[:ctx]


def reference(case: Case, q, kc, vc, tables, qsl_np, seq_np, chunk: int = 512):
    """float32 attention per row, queries in chunks (bottom-right causal, window, softcap)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    group = case.heads // case.kv_heads
    scale = case.head_dim**-0.5
    for r, (q_len, ctx) in enumerate(case.rows):
        k = gather(kc, tables[r], ctx).float().repeat_interleave(group, dim=1)  # [ctx, heads, d]
        v = gather(vc, tables[r], ctx).float().repeat_interleave(group, dim=1)
        keys = torch.arange(ctx, device="cuda")
        for i0 in range(0, q_len, chunk):
            i1 = min(q_len, i0 + chunk)
            qq = q[qsl_np[r] + i0:qsl_np[r] + i1].float()
            s = torch.einsum("qhd,khd->hqk", qq, k) * scale
            if case.softcap > 0:
                s = case.softcap * torch.tanh(s / case.softcap)
            pos = ctx - q_len + torch.arange(i0, i1, device="cuda")
            hidden = keys[None, :] > pos[:, None]
            if case.window > 0:
                hidden |= keys[None, :] <= pos[:, None] - case.window
            s = s.masked_fill(hidden[None], float("-inf"))
            out[qsl_np[r] + i0:qsl_np[r] + i1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


def flops(case: Case) -> float:
    total = 0
    for q_len, ctx in case.rows:
        pos = ctx - q_len + np.arange(q_len, dtype=np.float64)
        seen = pos + 1 if case.window <= 0 else np.minimum(pos + 1, case.window)
        total += seen.sum()
    return 4.0 * total * case.head_dim * case.heads


def time_us(fn, iters: int, repeats: int = 5) -> float:
    """Median microseconds of one call of `fn`, replaying a CUDA graph of `iters` calls.
    NOTE: a graph, not eager launches: on a slow host the small cases' eager times were
    the Python wrapper's (SmolLM2 16 x 512: 66 us eager, ~46 the kernel). The kernel is
    chosen when the graph is captured: set PAGEDCORE_PREFILL_KERNEL before."""
    return time_graph(fn, iters=iters, repeats=repeats)


def flash_varlen(case: Case, q, kc, vc, tables, qsl_np, seq_np):
    """FlashAttention-2 varlen (torch's vendored kernel) on contiguous keys: a callable,
    or None with the reason."""
    try:
        ks = torch.cat([gather(kc, tables[r], ctx) for r, (_, ctx) in enumerate(case.rows)]).contiguous()
        vs = torch.cat([gather(vc, tables[r], ctx) for r, (_, ctx) in enumerate(case.rows)]).contiguous()
        cu_q = torch.from_numpy(qsl_np).cuda()
        cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_np)]).astype(np.int32)).cuda()
        max_q = int(max(q_len for q_len, _ in case.rows))
        max_k = int(seq_np.max())
        kw = {"scale": case.head_dim**-0.5}
        if case.window > 0:
            kw.update(window_size_left=case.window - 1, window_size_right=0)
        if case.softcap > 0:
            return None, "softcap: no peer"
        if case.fp8:
            return None, "fp8 cache: no peer (FA2 over bf16 in the bf16 case)"

        def run():
            return torch.ops.aten._flash_attention_forward(q, ks, vs, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kw)[0]

        try:
            run()
        except RuntimeError:  # a build whose wrapper wants as many kv heads as query heads
            group = case.heads // case.kv_heads
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            run()
        return run, None
    except Exception as exc:  # the peer is context, not the check
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"


def diagnose(case: Case, out, want, plan, qsl_np) -> str:
    """Where a wrong output is wrong: head-dim halves, the CTA's two warpgroups (query
    vectors 0-63 / 64-127 of a work item), accumulator row halves (vector % 16 < 8),
    the first key tile of a row vs later positions; NaNs."""
    err = (out.float() - want).abs().nan_to_num(float("inf"))  # [tokens, heads, d]
    group = case.heads // case.kv_heads
    tile = plan.tile_tokens
    token_in_row = torch.zeros(out.shape[0], dtype=torch.long, device="cuda")
    pos = torch.zeros(out.shape[0], dtype=torch.long, device="cuda")
    for r, (q_len, ctx) in enumerate(case.rows):
        token_in_row[qsl_np[r]:qsl_np[r] + q_len] = torch.arange(q_len, device="cuda")
        pos[qsl_np[r]:qsl_np[r] + q_len] = ctx - q_len + torch.arange(q_len, device="cuda")
    vec = ((token_in_row % tile)[:, None] * group + torch.arange(case.heads, device="cuda")[None, :] % group)
    per_vec = err.amax(dim=2)  # [tokens, heads]
    parts = [f"wrong (>0.05) {float((per_vec > 0.05).float().mean()):.3f} of vectors",
             f"d<64 {float(err[..., :64].max()):.2e}", f"d>=64 {float(err[..., 64:].max()) if case.head_dim > 64 else 0:.2e}",
             f"wg0 {float(per_vec[vec < 64].max()):.2e}", f"wg1 {float(per_vec[vec >= 64].max()) if (vec >= 64).any() else 0:.2e}",
             f"rows g {float(per_vec[vec % 16 < 8].max()):.2e}", f"rows g+8 {float(per_vec[vec % 16 >= 8].max()):.2e}",
             f"pos<128 {float(per_vec[pos < 128].max()) if (pos < 128).any() else 0:.2e}",
             f"pos>=128 {float(per_vec[pos >= 128].max()) if (pos >= 128).any() else 0:.2e}",
             f"NaN vectors {int(torch.isnan(out).any(dim=2).sum())}"]
    return "; ".join(parts)


def scales(case: Case) -> dict:
    """paged_attention's k_scale / v_scale for an fp8 case."""
    return {"k_scale": case.fp8[0], "v_scale": case.fp8[1]} if case.fp8 else {}


def check(case: Case, iters: int) -> dict:
    q, kc, vc, tables, seq_lens, qsl, qsl_np, seq_np = build(case)
    plan = ops.plan_attention(qsl_np, seq_np, case.heads, case.kv_heads, torch.device("cuda"), case.head_dim,
                              case.dtype)
    if case.fp8:  # against the dequantized cache: the kernel's own error
        want = reference(case, q, kc.float() * case.fp8[0], vc.float() * case.fp8[1], tables, qsl_np, seq_np)
    else:
        want = reference(case, q, kc, vc, tables, qsl_np, seq_np)
    res = {"case": case.name, "splits": plan.num_splits, "tflop": flops(case) / 1e12}
    for kernel in KERNELS:
        os.environ[ENV] = kernel
        out = torch.full_like(q, float("nan"))

        def call():
            ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=case.head_dim**-0.5,
                                sliding_window=case.window, softcap=case.softcap, out=out, plan=plan, **scales(case))

        call()
        torch.cuda.synchronize()
        res[f"{kernel}_nan"] = int(torch.isnan(out).sum())
        res[f"{kernel}_err"] = float((out.float() - want).abs().nan_to_num(float("inf")).max())
        if res[f"{kernel}_err"] > 0.05:
            res[f"{kernel}_diagnosis"] = diagnose(case, out, want, plan, qsl_np)
        res[f"{kernel}_us"] = time_us(call, iters)
    os.environ.pop(ENV)
    fn, why = flash_varlen(case, q, kc, vc, tables, qsl_np, seq_np)
    res["flash_us"] = time_us(fn, iters) if fn is not None else None
    res["flash_note"] = why
    return res


def probe(kernel: str) -> None:
    """Runs `kernel` once on two small cases (one with key splits) and exits: what the
    parent times out on if the kernel hangs."""
    os.environ[ENV] = kernel
    for case in (EXTRA_CASES[0], EXTRA_CASES[2], EXTRA_CASES[-1]):  # (the last: an fp8 cache)
        q, kc, vc, tables, seq_lens, qsl, qsl_np, seq_np = build(case)
        ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=case.head_dim**-0.5, **scales(case))
    torch.cuda.synchronize()


def main() -> None:
    global KERNELS
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the small cases only")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--kernels", help="comma-separated variants to run, without the hang probes "
                        "(e.g. the ALIVE= line of an earlier run)")
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return
    print(f"{torch.cuda.get_device_name()}; wgmma kernels available: {_C.cuda_wgmma_prefill_available()}")
    # The building blocks alone first (one tile: S = Q K^T, O = P V against float math).
    try:
        errs = _C.cuda_wgmma_selftest()
        for i, name in enumerate(("bf16 d64", "bf16 d128", "fp16 d64", "fp16 d128", "bf16 d128 paired",
                                  "fp16 d128 paired")):
            print(f"selftest {name}: max |S - ref| {errs[2 * i]:.2e}, max |O - ref| {errs[2 * i + 1]:.2e}")
        selftest_bad = [i for i, e in enumerate(errs) if not (0 <= e < (1e-3 if i % 2 == 0 else 1e-2))]
    except RuntimeError as exc:
        print(f"selftest: {exc}")
        selftest_bad = ["error"]
    # NOTE: a kernel that deadlocks would take the whole device call with it: each
    # wgmma variant first runs in a child process with a time limit.
    alive, dropped = ["mma"], []
    if args.kernels:  # probed by an earlier run: no children
        alive += [k for k in args.kernels.split(",") if k and k != "mma"]
    # (all probes at once: a hung kernel does not stop the other processes' kernels)
    probes = {} if args.kernels else {
        kernel: subprocess.Popen([sys.executable, __file__, "--probe", kernel]) for kernel in KERNELS[1:]}
    deadline = time.monotonic() + PROBE_SECONDS
    for kernel, child in probes.items():
        try:
            code = child.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code == 0:
                alive.append(kernel)
            else:
                print(f"{kernel}: the probe failed (exit {code}); left out")
                dropped.append(f"[{kernel}: probe failed]")
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            print(f"{kernel}: HANGS (probe still running after {PROBE_SECONDS} s); left out")
            dropped.append(f"[{kernel}: hangs]")
    KERNELS = tuple(alive)
    # (for the device command: PAGEDCORE_TEST_PREFILL_KERNELS=$(... | sed -n 's/^ALIVE=//p'))
    print(f"ALIVE={','.join(alive)}", flush=True)
    cases = EXTRA_CASES + ([] if args.quick else ISSUE_CASES + FP8_CASES)
    rows = []
    with ops.unchecked_indices():
        for case in cases:
            try:
                rows.append(check(case, args.iters))
            except Exception as exc:
                rows.append({"case": case.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(rows[-1], flush=True)
    print()
    print(f"{'case':<42}{'splits':>7}  {'kernel':<19}{'max err':>10}{'NaN':>7}{'us':>10}{'TFLOP/s':>9}")
    bad = list(dropped) + (["[selftest]"] if selftest_bad else [])
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<42} ERROR {r['error']}")
            bad.append(r["case"])
            continue
        tf = r["tflop"] * 1e6
        for kernel in KERNELS:
            err, nan, us = r[f"{kernel}_err"], r[f"{kernel}_nan"], r[f"{kernel}_us"]
            print(f"{r['case']:<42}{r['splits']:>7}  {kernel:<19}{err:10.2e}{nan:7d}{us:10.1f}{tf / us:9.0f}")
            if kernel != "mma" and (nan or not math.isfinite(err) or err > 0.05):
                bad.append(f"{r['case']} [{kernel}]")
                print(f"{'':<51}where: {r.get(f'{kernel}_diagnosis', 'NaN only')}")
        if r["flash_us"]:
            print(f"{r['case']:<42}{r['splits']:>7}  {'FA2':<19}{'':>10}{'':>7}{r['flash_us']:10.1f}"
                  f"{tf / r['flash_us']:9.0f}")
        correct = [k for k in KERNELS if k != "mma" and not r[f"{k}_nan"] and r[f"{k}_err"] <= 0.05]
        if correct:
            best = min(correct, key=lambda k: r[f"{k}_us"])
            vs = f", {r['flash_us'] / r[f'{best}_us']:.2f}x FA2's speed" if r["flash_us"] else ""
            print(f"{'':<51}fastest correct wgmma variant: {best} {r[f'{best}_us']:.1f} us{vs}")
    # Issue 12's block-size target: 8k causal at block size 16 within 5% of 128, per variant.
    by_name = {r["case"]: r for r in rows if "error" not in r}
    r16, r128 = by_name.get(ISSUE_CASES[0].name), by_name.get(ISSUE_CASES[1].name)
    if r16 and r128:
        ratios = [f"{k} {r16[f'{k}_us'] / r128[f'{k}_us']:.3f}" for k in KERNELS if k != "mma"]
        print(f"8k causal, bs16 time / bs128 time: {', '.join(ratios)} (target <= 1.05)")
    # The fp8 cache at 8k causal against mma.sync over it and the bf16 cache's fastest kernel.
    r8, r16 = by_name.get(FP8_CASES[0].name), by_name.get(ISSUE_CASES[0].name)
    if r8 and r16 and "wgmma-tma-fp8" in KERNELS:
        best16 = min((k for k in KERNELS if k != "wgmma-tma-fp8"), key=lambda k: r16[f"{k}_us"])
        print(f"8k causal, fp8 cache: wgmma-tma-fp8 {r8['wgmma-tma-fp8_us']:.1f} us, mma.sync {r8['mma_us']:.1f} us; "
              f"bf16 cache {best16} {r16[f'{best16}_us']:.1f} us")
    for note in {r["flash_note"] for r in rows if r.get("flash_note")}:
        print(f"FA2 peer: {note}")
    print("wgmma kernels: OK" if not bad else f"wgmma kernels: FAILED on {bad}")


if __name__ == "__main__":
    main()
