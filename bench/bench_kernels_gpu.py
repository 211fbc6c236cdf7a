#!/usr/bin/env python3
"""GPU kernels of pagedcore.ops against the peers on the same data, on one GPU.

Decode attention over a paged bf16 cache vs torch SDPA on the same keys laid out
contiguously (the memory-bandwidth bound the issue compares with); prefill; cache
write, block copy and swap bandwidth; the fused layer ops (RMSNorm, add + RMSNorm,
rotary, SiLU-and-multiply) vs the unfused torch arithmetic they replace, at the
SmolLM2 and Llama-3-8B shapes for one token and 4096. Each case: warm-up, then CUDA-graph replays
timed with events, median of repeats; achieved GB/s against the copy bandwidth
measured in the same run. Prefill (issue 12's cases: 8k causal at block sizes 16
and 128, 2048 new over 6144 cached, 16 x 512 over 1-4k cached, the SmolLM2 shape):
the prefill kernels (PAGEDCORE_PREFILL_KERNEL=mma / wgmma / wgmma-tma / wgmma-tma-pairs; the default at head dim
128: -pairs up to block size 32, wgmma-tma above) beside FlashAttention-2
varlen (SDPA's flash kernel) on contiguous keys and FlashInfer's paged prefill, in
TFLOP/s. Prints the tables last. With --only decode: the decode rows, FlashInfer's, and
issue 13's cases at block sizes 16 and 128 over the same keys with their graphs replayed
in alternation (the block-size check without the run's drift between them).

Usage: python3 bench/bench_kernels_gpu.py [--quick] [--only decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from pagedcore import ops


def time_eager(fn, iters: int = 5, repeats: int = 7) -> float:
    """Median microseconds of one call, eager launches timed with events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


def time_graph(fn, iters: int = 20, repeats: int = 7, warm_ms: float = 50.0) -> float:
    """Median microseconds of one call, replaying a CUDA graph of `iters` calls after
    `warm_ms` of warm replays (the GPU's clocks settle after a heavier case before it)."""
    graph = graph_of(fn, iters)
    warm(graph, warm_ms)
    return statistics.median(replay_us(graph, iters, repeats))


def warm(graph: torch.cuda.CUDAGraph, ms: float) -> None:
    """Replays `graph` for about `ms` milliseconds of GPU time (at most 2,000 times)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    for _ in range(min(2000, int(ms / max(start.elapsed_time(end), 1e-3)))):
        graph.replay()
    torch.cuda.synchronize()


def graph_of(fn, iters: int = 20) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `iters` calls of `fn` (after three warm-up calls), replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, iters: int, repeats: int = 7) -> list[float]:
    """Microseconds of one call in each of `repeats` replays of a graph of `iters` calls."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return times


def time_host(fn, repeats: int = 5) -> float:
    """Median microseconds of one call from the host's clock, the GPU drained before
    and after (for calls that wait on the host, like swaps)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = time_graph(lambda: b.copy_(a), iters=5)
    return 2 * a.numel() / us / 1e3


def flashinfer_decode(q, kc, vc, tables, ctx: int, block_size: int, layout: str = "NHD"):
    """FlashInfer's tensor-core paged decode on the same cache (NHD layout, the same
    as ours; HND: [blocks, kv heads, block size, head dim]), CUDA-graph timed: (us,
    output) or (None, why not)."""
    try:
        import flashinfer
    except ImportError:
        return None, "not installed (bench/fetch_peer_wheels.sh, carry .peers)"
    try:
        wrapper = flashinfer_wrapper(flashinfer, q, kc, tables, ctx, block_size, layout)
        out = wrapper.run(q, (kc, vc))
        return time_graph(lambda: wrapper.run(q, (kc, vc))), out
    except Exception as exc:  # a peer that fails is reported, not fatal
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def flashinfer_wrapper(flashinfer, q, kc, tables, ctx: int, block_size: int, layout: str = "NHD"):
    """FlashInfer's tensor-core paged decode planned for `q` over the cache `kc`'s
    layout (every row `ctx` keys): the wrapper, whose run(q, (kc, vc)) decodes."""
    batch, heads, hd = q.shape
    per = tables.shape[1]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per
    indices = tables.reshape(-1).contiguous()
    last = torch.full((batch,), ctx - (per - 1) * block_size, dtype=torch.int32, device="cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, layout, use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    kv_heads = kc.shape[2] if layout == "NHD" else kc.shape[1]
    wrapper.plan(indptr, indices, last, heads, kv_heads, hd, block_size, q_data_type=q.dtype,
                 kv_data_type=kc.dtype, sm_scale=hd**-0.5)
    return wrapper


def contiguous_kv(kc, vc, tables, ctx: int, dtype: torch.dtype):
    """The rows' first `ctx` keys and values of a paged cache [blocks, bs, kv heads, hd]
    gathered through `tables` into contiguous [batch, kv heads, ctx, hd] tensors of `dtype`."""
    batch, per = tables.shape
    bs, kv_heads, hd = kc.shape[1:]
    idx = tables.long()
    return tuple(c[idx].view(batch, per * bs, kv_heads, hd)[:, :ctx].transpose(1, 2).to(dtype).contiguous()
                 for c in (kc, vc))


def random_paged_cache(batch: int, ctx: int, kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, g: torch.Generator):
    """Random K and V caches [blocks, block_size, kv heads, head dim] (block 0 unused) and
    `batch` rows' block tables over shuffled blocks, for rows of `ctx` keys."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq + 1
    kc = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    tables = (torch.randperm(num_blocks - 1, generator=g, device="cuda").to(torch.int32) + 1)[
        : batch * blocks_per_seq].view(batch, blocks_per_seq).contiguous()
    return kc, vc, tables


def decode_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                fp8: bool = False, graph_plan_len: int = 0, label: str = ""):
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables = random_paged_cache(batch, ctx, kv_heads, head_dim, block_size, dtype, g)
    if fp8:  # the cache in e4m3 (scale 1); the peer reads the same values in bf16
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    q = torch.randn((batch, heads, head_dim), generator=g, device="cuda", dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl_np = np.arange(batch + 1, dtype=np.int32)
    qsl = torch.from_numpy(qsl_np).cuda()
    plan = ops.plan_attention(qsl_np, np.full(batch, ctx), heads, kv_heads, torch.device("cuda"), head_dim, dtype)
    if graph_plan_len:  # the plan the model's decode graphs hold: splits for their longest row
        plan = ops.plan_decode(batch, kv_heads, torch.device("cuda"), graph_plan_len)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ours = time_graph(lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=scale, out=out, plan=plan))
    # Peer: SDPA over the same keys gathered contiguously (GQA expanded by enable_gqa).
    k, v = contiguous_kv(kc, vc, tables, ctx, dtype)
    qq = q.view(batch, heads, 1, head_dim)
    ref = F.scaled_dot_product_attention(qq, k, v, enable_gqa=True, scale=scale)
    err = (out.float().view_as(ref) - ref.float()).norm() / ref.float().norm()
    theirs = time_graph(lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True, scale=scale))
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * kc.element_size()
    if not fp8:
        fi_us, fi_out = flashinfer_decode(q, kc, vc, tables, ctx, block_size)
        if fi_us is not None:
            fi_err = (fi_out.float().view_as(ref) - ref.float()).norm() / ref.float().norm()
            FLASHINFER[label or f"decode B={batch} L={ctx} bs={block_size} ({heads}/{kv_heads}, d{head_dim})"] = (
                fi_us, float(fi_err))
        else:
            FLASHINFER["error"] = fi_out
    return ours, theirs, kv_bytes, float(err)


def after_cache_write_case(batch: int, ctx: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                           block_size: int = 16) -> tuple[float, float, float]:
    """A decode step's attention as the model launches it: behind the rotary kernel that
    writes the step's keys and values into the cache (both with PDL). Returns the graph
    times of rotary + attention and of the rotary alone (us): their difference is what
    the attention adds to a layer; and the attention's relative error against SDPA on the
    last replay's queries and cache (each replay rotates q and k in place again)."""
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(3)
    kc, vc, tables = random_paged_cache(batch, ctx, kv_heads, head_dim, block_size, dtype, g)
    qkv = torch.randn((batch, (heads + 2 * kv_heads) * head_dim), generator=g, device="cuda", dtype=dtype)
    q = qkv[:, : heads * head_dim].view(batch, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(batch, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(batch, kv_heads, head_dim)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
    last = tables[:, (ctx - 1) // block_size].long()
    slots = last * block_size + (ctx - 1) % block_size
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cuda") / head_dim))
    table = ops.cos_sin_cache(inv_freq.float(), 8192)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl_np = np.arange(batch + 1, dtype=np.int32)
    qsl = torch.from_numpy(qsl_np).cuda()
    plan = ops.plan_attention(qsl_np, np.full(batch, ctx), heads, kv_heads, torch.device("cuda"), head_dim, dtype)
    out = torch.empty_like(q)

    def rotary():
        ops.rotary_embedding(positions, q, k, table, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots)

    def both():
        rotary()
        ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=head_dim**-0.5, out=out, plan=plan)

    pair_us = time_graph(both)
    k_all, v_all = contiguous_kv(kc, vc, tables, ctx, dtype)
    ref = F.scaled_dot_product_attention(q.reshape(batch, heads, 1, head_dim), k_all, v_all, enable_gqa=True,
                                         scale=head_dim**-0.5)
    err = (out.float().view_as(ref) - ref.float()).norm() / ref.float().norm()
    return pair_us, time_graph(rotary), float(err)


def multi_query_case(batch: int, queries: int, ctx: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    """Rows of a few queries each (speculative decoding): the decode kernel's time, and
    the prefill kernel's on the same rows (the plan without the decode path)."""
    dtype, block_size = torch.bfloat16, 16
    g = torch.Generator(device="cuda").manual_seed(2)
    kc, vc, tables = random_paged_cache(batch, ctx, kv_heads, head_dim, block_size, dtype, g)
    q = torch.randn((batch * queries, heads, head_dim), generator=g, device="cuda", dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl_np = np.arange(batch + 1, dtype=np.int32) * queries
    qsl = torch.from_numpy(qsl_np).cuda()
    scale = head_dim**-0.5
    lens = np.full(batch, ctx)
    times, outs = [], []
    for fast in (True, False):
        plan = (ops.plan_attention(qsl_np, lens, heads, kv_heads, torch.device("cuda"), head_dim, dtype) if fast
                else ops.plan_attention(qsl_np, lens, heads, kv_heads, torch.device("cuda")))
        assert (plan.num_decode == batch) == fast
        out = torch.empty_like(q)
        times.append(time_graph(lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=scale, out=out,
                                                            plan=plan)))
        outs.append(out)
    err = ((outs[0].float() - outs[1].float()).norm() / outs[1].float().norm()).item()
    return times[0], times[1], 2 * batch * ctx * kv_heads * head_dim * 2, err


def block_size_pair(batch: int, ctx: int, fp8: bool = False, heads: int = 32, kv_heads: int = 8,
                    head_dim: int = 128, sizes: tuple = (16, 128), rounds: int = 7) -> tuple[list[float], float]:
    """One decode step over the same keys paged in blocks of each of `sizes` (shuffled
    blocks), its graphs replayed in alternation for `rounds` rounds, so that the GPU's
    drift over a run falls on every size alike (the table above times each size's case
    once, all of block size 16 before any of 128). Returns each size's median us and the
    largest relative difference of the outputs from the first size's."""
    g = torch.Generator(device="cuda").manual_seed(4)
    tokens = -(-ctx // max(sizes)) * max(sizes)  # whole blocks of every size
    keys = torch.randn((batch, tokens, kv_heads, head_dim), generator=g, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn((batch, heads, head_dim), generator=g, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl_np = np.arange(batch + 1, dtype=np.int32)
    qsl = torch.from_numpy(qsl_np).cuda()
    graphs, outs, calls = [], [], []  # (each call's default arguments keep its caches, table and plan alive)
    for bs in sizes:
        per = tokens // bs
        tables = (torch.randperm(batch * per, generator=g, device="cuda").to(torch.int32) + 1).view(batch, per)
        caches = []
        for src in (keys, values):
            cache = torch.zeros((batch * per + 1, bs, kv_heads, head_dim), device="cuda", dtype=torch.bfloat16)
            cache[tables.flatten().long()] = src.view(batch * per, bs, kv_heads, head_dim)
            caches.append(cache.to(torch.float8_e4m3fn) if fp8 else cache)
        plan = ops.plan_attention(qsl_np, np.full(batch, ctx), heads, kv_heads, torch.device("cuda"), head_dim,
                                  torch.bfloat16)
        out = torch.empty_like(q)
        fn = lambda kc=caches[0], vc=caches[1], t=tables, plan=plan, out=out: ops.paged_attention(  # noqa: E731
            q, kc, vc, t, seq_lens, qsl, scale=head_dim**-0.5, out=out, plan=plan)
        graphs.append(graph_of(fn))
        outs.append(out)
        calls.append(fn)
    for graph in graphs:
        warm(graph, 20.0)
    samples = [[] for _ in sizes]
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            samples[i] += replay_us(graph, 20, 3)
    diff = max(((o.float() - outs[0].float()).norm() / outs[0].float().norm()).item() for o in outs)
    return [statistics.median(t) for t in samples], diff


FLASHINFER: dict = {}  # the case's row name -> (us, rel err), or "error" -> why


def prefill_case(tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    nb = -(-tokens // block_size) + 1
    kc = torch.randn((nb, block_size, kv_heads, head_dim), generator=g, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.arange(1, nb, dtype=torch.int32, device="cuda").view(1, -1)
    q = torch.randn((tokens, heads, head_dim), generator=g, device="cuda", dtype=dtype)
    qsl_np = np.array([0, tokens], dtype=np.int32)
    plan = ops.plan_attention(qsl_np, np.array([tokens]), heads, kv_heads, torch.device("cuda"), head_dim, dtype)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    qsl = torch.from_numpy(qsl_np).cuda()
    out = torch.empty_like(q)
    ours = time_graph(lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=head_dim**-0.5, out=out, plan=plan), iters=3, repeats=5)
    # Peer: SDPA's flash backend on contiguous [1, heads, tokens, d] (kv heads expanded: flash has no GQA).
    group = heads // kv_heads
    k = kc[1:].reshape(-1, kv_heads, head_dim)[:tokens].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()
    v = vc[1:].reshape(-1, kv_heads, head_dim)[:tokens].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qq, k, v, is_causal=True)
        theirs = time_graph(lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True), iters=3, repeats=5)
    err = (out.float().transpose(0, 1).unsqueeze(0) - ref.float()).norm() / ref.float().norm()
    return ours, theirs, float(err)


def flashinfer_prefill(case, q, kc, vc, tables, qsl_np, seq_np):
    """FlashInfer's paged prefill on the same cache (NHD, causal): a callable, or None
    with the reason."""
    try:
        import flashinfer
    except ImportError:
        return None, "not installed (bench/fetch_peer_wheels.sh, carry .peers)"
    try:
        bs = case.block_size
        per = [-(-int(ctx) // bs) for ctx in seq_np]
        kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(per)]), dtype=torch.int32, device="cuda")
        indices = torch.cat([tables[r, :n] for r, n in enumerate(per)]).contiguous()
        last = torch.tensor([int(ctx) - (n - 1) * bs for ctx, n in zip(seq_np, per)], dtype=torch.int32,
                            device="cuda")
        qo_indptr = torch.from_numpy(qsl_np).cuda()
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(qo_indptr, kv_indptr, indices, last, case.heads, case.kv_heads, case.head_dim, bs,
                     causal=True, q_data_type=q.dtype, kv_data_type=kc.dtype, sm_scale=case.head_dim**-0.5)
        wrapper.run(q, (kc, vc))
        return (lambda: wrapper.run(q, (kc, vc))), None
    except Exception as exc:  # a peer that fails is reported, not fatal
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def prefill_kernel_rows(quick: bool) -> tuple[list[tuple], list[str]]:
    """The issue's prefill cases (bench/check_wgmma.py builds them: NaN-poisoned paged
    cache, scattered blocks) on every prefill kernel (PAGEDCORE_PREFILL_KERNEL=mma,
    wgmma, wgmma-tma, wgmma-tma-pairs; one plan), FlashAttention-2 varlen (SDPA's flash kernel,
    bottom-right causal, GQA) on the keys laid out contiguously, and FlashInfer's paged
    prefill when present: (case, kernel, us, TFLOP/s, max abs err vs float32 math) rows."""
    import os

    import check_wgmma as cw

    cases = cw.ISSUE_CASES[2:] if quick else cw.ISSUE_CASES
    rows, notes = [], []
    for case in cases:
        q, kc, vc, tables, seq_lens, qsl, qsl_np, seq_np = cw.build(case)
        plan = ops.plan_attention(qsl_np, seq_np, case.heads, case.kv_heads, torch.device("cuda"),
                                  case.head_dim, case.dtype)
        want = cw.reference(case, q, kc, vc, tables, qsl_np, seq_np)
        tflop = cw.flops(case) / 1e12
        out = torch.empty_like(q)
        before = os.environ.get(cw.ENV)
        for kernel in ("mma", "wgmma", "wgmma-tma", "wgmma-tma-pairs"):
            os.environ[cw.ENV] = kernel
            fn = lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale=case.head_dim**-0.5, out=out,
                                             plan=plan)
            fn()
            err = float((out.float() - want).abs().nan_to_num(float("inf")).max())
            us = time_eager(fn, iters=3, repeats=5)
            rows.append((case.name, f"pagedcore {kernel}", us, tflop * 1e6 / us, err))
        os.environ.pop(cw.ENV)
        if before is not None:  # (a kernel the caller had chosen)
            os.environ[cw.ENV] = before
        for peer, (fn, why) in (("FA2 varlen (SDPA flash)", cw.flash_varlen(case, q, kc, vc, tables, qsl_np, seq_np)),
                                ("FlashInfer paged", flashinfer_prefill(case, q, kc, vc, tables, qsl_np, seq_np))):
            if fn is None:
                notes.append(f"{peer}: {why}")
                continue
            o = fn()
            err = float((o.float().view_as(want) - want).abs().max())
            us = time_eager(fn, iters=3, repeats=5)
            rows.append((case.name, peer, us, tflop * 1e6 / us, err))
    return rows, sorted(set(notes))


def _torch_rms_norm(x, w, eps, residual=None):
    if residual is not None:
        x = residual + x
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rotary(q, k, positions, inv_freq):
    # The decoder's rotary before the fused kernel: cos/sin from positions every step.
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    half = q.shape[-1] // 2

    def rotate(x):
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def layer_op_rows(quick: bool) -> list[tuple]:
    """(name, ours us, torch us, GB/s, rel err) of the fused layer ops."""
    rows = []
    dtype, eps = torch.bfloat16, 1e-5
    shapes = {"SmolLM2": (576, 1536, 9, 3, 64), "8B": (4096, 14336, 32, 8, 128)}
    for shape, (hidden, inter, heads, kv_heads, d) in shapes.items():
        for tokens in ((1, 4096) if not quick else (1,)):
            x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
            res = torch.randn_like(x)
            w = torch.randn(hidden, dtype=dtype, device="cuda")
            out = torch.empty_like(x)
            ref = _torch_rms_norm(x, w, eps)
            err = ((ops.rms_norm(x, w, eps, out=out).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ours = time_graph(lambda: ops.rms_norm(x, w, eps, out=out))
            theirs = time_graph(lambda: _torch_rms_norm(x, w, eps))
            rows.append((f"rms_norm {shape} T={tokens}", ours, theirs, 2 * x.numel() * 2 / ours / 1e3, err))
            xs, rs = x.clone(), res.clone()
            ours = time_graph(lambda: ops.fused_add_rms_norm(xs, rs, w, eps))
            theirs = time_graph(lambda: _torch_rms_norm(x, w, eps, residual=res))
            rows.append((f"add + rms_norm {shape} T={tokens}", ours, theirs, 4 * x.numel() * 2 / ours / 1e3, 0.0))

            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device="cuda")
            q = qkv[:, : heads * d].view(tokens, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
            table = ops.cos_sin_cache(inv_freq, 8192)
            positions = torch.randint(0, 8192, (tokens,), dtype=torch.int32, device="cuda")
            want_q, _ = _torch_rotary(q, k, positions, inv_freq)
            q0 = q.clone()
            ops.rotary_embedding(positions, q, k, table)
            err = ((q.float() - want_q.float()).abs().max() / want_q.float().abs().max()).item()
            q.copy_(q0)
            ours = time_graph(lambda: ops.rotary_embedding(positions, q, k, table))
            theirs = time_graph(lambda: _torch_rotary(q, k, positions, inv_freq))
            nbytes = 2 * tokens * (heads + kv_heads) * d * 2 + tokens * d * 4
            rows.append((f"rotary {shape} T={tokens} ({heads}/{kv_heads}, d{d})", ours, theirs, nbytes / ours / 1e3, err))

            gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda")
            act = torch.empty(tokens, inter, dtype=dtype, device="cuda")
            want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            err = ((ops.silu_and_mul(gate_up, out=act).float() - want.float()).abs().max()
                   / want.float().abs().max()).item()
            ours = time_graph(lambda: ops.silu_and_mul(gate_up, out=act))
            theirs = time_graph(lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
            rows.append((f"silu_and_mul {shape} T={tokens}", ours, theirs, 3 * act.numel() * 2 / ours / 1e3, err))
    return rows


def linear_rows(quick: bool) -> list[tuple]:
    """(name, ours us, cuBLAS us, GB/s of weight read by ours, rel err) of the decode steps' products
    at M = 1, 2, 4, 8, 16 rows (quick: 1, 4, 16): the one-row kernel at M = 1, the tensor-core one
    above, and at M = 16 (not quick) the tensor-core kernel with each split of k forced. Each
    graph cycles through copies of the weight that together exceed the L2 cache (>= 128 MB), as
    a model's layers do, so that the weight comes from DRAM at every call."""
    dtype = torch.bfloat16
    shapes = {
        "SmolLM2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                    "lm_head": (576, 49152)},
        "8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
               "lm_head": (4096, 128256)},
    }
    token_counts = (1, 2, 4, 8, 16) if not quick else (1, 4, 16)
    found = {}
    for shape, layers in shapes.items():
        for name, (k, n) in layers.items():
            copies = max(1, -(-(128 << 20) // (n * k * 2)))
            weights = [torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5 for _ in range(copies)]
            for tokens in token_counts:
                x = torch.randn(tokens, k, dtype=dtype, device="cuda")
                out = torch.empty(tokens, n, dtype=dtype, device="cuda")
                ref = F.linear(x, weights[0])
                got = ops.linear(x, weights[0], out=out).float()
                err = ((got - ref.float()).abs().max() / ref.float().abs().max()).item()
                calls = [0, 0]

                def ours_call():
                    ops.linear(x, weights[calls[0] % copies], out=out)
                    calls[0] += 1

                def cublas_call():
                    F.linear(x, weights[calls[1] % copies])
                    calls[1] += 1

                ours = time_graph(ours_call, iters=max(20, copies))
                theirs = time_graph(cublas_call, iters=max(20, copies))
                found[(shape, tokens, name)] = [(f"linear {shape} {name} M={tokens} ({k}->{n})", ours, theirs,
                                                 n * k * 2 / ours / 1e3, err)]
                # The tensor-core kernel's split of k forced (PAGEDCORE_LINEAR_PARTS, read at each
                # launch): where its cost model's choice stands among the others.
                for parts in (1, 2, 4, 8, 16, 32, 64) if tokens == 16 and not quick else ():
                    if parts > -(-k // 32):
                        break
                    before = os.environ.get("PAGEDCORE_LINEAR_PARTS")
                    os.environ["PAGEDCORE_LINEAR_PARTS"] = str(parts)
                    try:
                        us = time_graph(ours_call, iters=max(20, copies))
                    finally:
                        os.environ.pop("PAGEDCORE_LINEAR_PARTS")
                        if before is not None:
                            os.environ["PAGEDCORE_LINEAR_PARTS"] = before
                    found[(shape, tokens, name)].append((f"  same, k split in <= {parts} parts", us, theirs,
                                                         n * k * 2 / us / 1e3, err))
            del weights
    return [row for shape, layers in shapes.items() for tokens in token_counts for name in layers
            for row in found[(shape, tokens, name)]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("decode",), default=None,
                        help="decode: the decode attention rows alone (and FlashInfer's)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with ops.unchecked_indices():  # checks synchronise; graphs cannot capture that
        run(args)


def run(args) -> None:
    bw = copy_bandwidth()
    rows = []
    cases = [(1, 256), (1, 4096), (1, 32768), (64, 1024), (64, 4096)]
    if args.quick:
        cases = [(1, 256), (1, 4096), (64, 4096)]
    for block_size in (16, 128):
        for batch, ctx in cases:
            ours, theirs, nbytes, err = decode_case(batch, ctx, 32, 8, 128, block_size)
            rows.append((f"decode B={batch} L={ctx} bs={block_size} (32/8, d128)", ours, theirs, nbytes / ours / 1e3, err))
    ours, theirs, nbytes, err = decode_case(64, 1024, 9, 3, 64, 16, label="decode SmolLM2 B=64 L=1k (9/3, d64)")
    rows.append(("decode SmolLM2 B=64 L=1k (9/3, d64)", ours, theirs, nbytes / ours / 1e3, err))
    # The batch-1 attention as a layer runs it: behind the rotary's cache write (PDL).
    for ctx in (256, 4096):
        pair_us, rotary_us, err = after_cache_write_case(1, ctx)
        rows.append((f"decode B=1 L={ctx} bs=16 behind the rotary's cache write (rotary alone {rotary_us:.1f} us)",
                     pair_us - rotary_us, None, 2 * ctx * 8 * 128 * 2 / (pair_us - rotary_us) / 1e3, err))
    # A batch-1 decode step early in a generation, under the decode graphs' plan (max_model_len 8192).
    for name, shape in (("8B", (32, 8, 128)), ("SmolLM2", (9, 3, 64))):
        label = f"decode {name} B=1 L=160, graph plan (max 8192)"
        ours, theirs, nbytes, err = decode_case(1, 160, *shape, 16, graph_plan_len=8192, label=label)
        rows.append((label, ours, theirs, nbytes / ours / 1e3, err))
    for batch, queries, ctx in ((1, 4, 4096), (64, 4, 1024), (64, 4, 4096)):
        ours, prefill_kernel, nbytes, err = multi_query_case(batch, queries, ctx, 32, 8, 128)
        rows.append((f"decode {queries} queries/row B={batch} L={ctx} vs prefill kernel", ours, prefill_kernel,
                     nbytes / ours / 1e3, err))
    bf16_us = next(r[1] for r in rows if r[0].startswith("decode B=64 L=4096 bs=16"))
    ours, theirs, nbytes, err = decode_case(64, 4096, 32, 8, 128, 16, fp8=True)
    rows.append(("decode fp8 KV B=64 L=4096 bs=16 (32/8, d128)", ours, theirs, nbytes / ours / 1e3, err))
    fp8_ratio = ours / bf16_us
    four_us = next(r[1] for r in rows if r[0].startswith("decode 4 queries/row B=64 L=4096"))
    if args.only == "decode":
        print_rows(bw, rows)
        print(f"fp8 KV / bf16 KV time at B=64 L=4k bs=16: {fp8_ratio:.3f}x")
        print(f"4 queries a row / 1 query a row at B=64 L=4k bs=16: {four_us / bf16_us:.3f}x")
        print_flashinfer(rows)
        print_block_size_pairs()
        return

    # Cache write of 16k tokens, block copy, swap.
    kv, hd = 8, 128
    kc = torch.zeros((2048, 16, kv, hd), dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    key = torch.randn((16384, kv, hd), dtype=torch.bfloat16, device="cuda")
    val = torch.randn_like(key)
    slots = torch.randperm(2048 * 16, device="cuda")[:16384].to(torch.int32)
    us = time_graph(lambda: ops.reshape_and_cache(key, val, kc, vc, slots))
    write_bytes = 2 * 2 * key.numel() * 2
    rows.append(("cache write 16k tokens (8 kv heads, d128)", us, None, write_bytes / us / 1e3, 0.0))
    layers = [torch.randn((4096, 16, kv, hd), dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    pairs = torch.stack([torch.arange(0, 1024), torch.arange(2048, 3072)], dim=1).cuda()
    # Eager: the call uploads its table of cache addresses (not capturable).
    us = time_eager(lambda: ops.copy_blocks(layers[:4], layers[4:], pairs))
    copy_bytes = 2 * 8 * 1024 * layers[0][0].numel() * 2
    rows.append(("block copy 1024 pairs x 8 caches", us, None, copy_bytes / us / 1e3, 0.0))
    cpu = [torch.zeros((1100, 16, kv, hd), dtype=torch.bfloat16).pin_memory() for _ in range(8)]
    out_pairs = torch.stack([torch.arange(1024), torch.arange(1024)], dim=1)
    ops.swap_out(layers, cpu, out_pairs)
    torch.cuda.synchronize()
    swap_bytes = 8 * 1024 * layers[0][0].numel() * 2
    us = time_host(lambda: ops.swap_in(cpu, layers, out_pairs))
    rows.append(("swap-in 1024 blocks x 8 caches (H2D)", us, None, swap_bytes / us / 1e3, 0.0))
    us = time_host(lambda: ops.swap_out(layers, cpu, out_pairs))
    rows.append(("swap-out 1024 blocks x 8 caches (D2H)", us, None, swap_bytes / us / 1e3, 0.0))

    rows += layer_op_rows(args.quick)
    rows += linear_rows(args.quick)

    prefill_rows, prefill_notes = prefill_kernel_rows(args.quick)
    prefill_ours, prefill_sdpa, prefill_err = prefill_case(8192 if not args.quick else 2048, 32, 8, 128)
    prefill_flops = 4 * 8192 * 8192 / 2 * 32 * 128 if not args.quick else 4 * 2048 * 2048 / 2 * 32 * 128

    print_rows(bw, rows)
    print(f"{'prefill 8k causal (32/8, d128) vs SDPA flash':<48}{prefill_ours:14.1f}{prefill_sdpa:10.1f}"
          f"{prefill_sdpa / prefill_ours:10.2f}x{prefill_flops / prefill_ours / 1e6:7.0f} TFLOP/s{prefill_err:9.1e}")
    print(f"fp8 KV / bf16 KV time at B=64 L=4k bs=16: {fp8_ratio:.3f}x")
    print(f"4 queries a row / 1 query a row at B=64 L=4k bs=16: {four_us / bf16_us:.3f}x")
    print(f"\n{'prefill case':<42}{'kernel':<26}{'us':>10}{'TFLOP/s':>9}{'max err':>10}")
    for name, kernel, us, tflops, err in prefill_rows:
        print(f"{name:<42}{kernel:<26}{us:10.1f}{tflops:9.0f}{err:10.1e}")
    for note in prefill_notes:
        print(f"prefill peer {note}")
    print_flashinfer(rows)


def print_rows(bw: float, rows: list[tuple]) -> None:
    print(f"\ncopy bandwidth (read+write): {bw:.0f} GB/s; {torch.cuda.get_device_name()}")
    print(f"{'case':<48}{'pagedcore us':>14}{'peer us':>10}{'peer/ours':>11}{'GB/s':>9}{'rel err':>10}")
    for name, ours, theirs, gbs, err in rows:
        peer = f"{theirs:10.1f}{theirs / ours:10.2f}x" if theirs is not None else f"{'-':>10}{'-':>11}"
        print(f"{name:<48}{ours:14.1f}{peer}{gbs:9.0f}{err:10.1e}")


def print_block_size_pairs() -> None:
    """Issue 13's cases at block sizes 16 and 128 over the same keys, in alternation."""
    print("\nblock size 16 / 128 over the same keys, graphs replayed in alternation (median us):")
    worst = 0.0
    for batch, ctx, fp8 in ((1, 256, False), (1, 4096, False), (1, 32768, False), (64, 1024, False),
                            (64, 4096, False), (64, 4096, True)):
        (a, b), diff = block_size_pair(batch, ctx, fp8)
        worst = max(worst, max(a, b) / min(a, b) - 1)
        print(f"  {'fp8 ' if fp8 else ''}B={batch} L={ctx}: {a:.2f} / {b:.2f} us ({a / b:.3f}x; outputs differ by "
              f"{diff:.1e} relative)")
    print(f"block sizes 16 and 128 within {100 * worst:.1f}% of each other on every case")


def print_flashinfer(rows: list[tuple]) -> None:
    if "error" in FLASHINFER:
        print(f"FlashInfer 0.6.13 peer: {FLASHINFER['error']}")
    for label, (us, err) in FLASHINFER.items() if "error" not in FLASHINFER else []:
        ours = next(r[1] for r in rows if r[0] == label)
        print(f"FlashInfer {label}: {us:.1f} us (ours {ours:.1f}, FlashInfer / ours {us / ours:.2f}x, "
              f"rel err vs SDPA {err:.1e})")


if __name__ == "__main__":
    main()
