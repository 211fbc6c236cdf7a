"""pagedcore.ops on CUDA against the same float64 references as the CPU tests:
fresh random inputs, outputs poisoned with NaN, NaN in every cache slot a kernel
must not read, over block sizes, head dims, GQA ratios, dtypes, mixed rows
(decode, cached prefix + chunk, whole prompts), sliding window, softcap, and
key splits for few long rows."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagedcore import _C, ops

pytestmark = pytest.mark.cuda

from test_ops_cpu import DTYPES, NAN, make_batch, mixed_rows, reference  # noqa: E402

DEV = "cuda"

# __expf and float32 accumulation on the GPU.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}


def run_cuda(rows, *, block_size, head_dim, group, dtype, window=0, softcap=0.0, num_kv_heads=2, seed=0,
             fp8_scales=None, unsplit=False, graph_plan_len=0, repeat=1, head_scales=None, mixed_graph=None):
    query, kc, vc, bt, seq_lens, qsl = make_batch(
        rows, block_size=block_size, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
        dtype=dtype, window=window, seed=seed,
    )
    if head_scales is not None:  # each query head times its factor (the reference sees the same values)
        query = (query.float() * torch.tensor(head_scales).view(1, -1, 1)).to(dtype)
    # Garbage table entries past a row's blocks must not be read; on the GPU keep
    # them in range so that a stray read shows as NaN rather than a fault.
    bt = bt.clamp(0, kc.shape[0] - 1)
    scale = head_dim**-0.5
    kw = {}
    if fp8_scales is not None:  # the cache in e4m3 (NaN stays NaN); the reference reads it back
        k_scale, v_scale = fp8_scales
        kc = (kc.float() / k_scale).to(torch.float8_e4m3fn)
        vc = (vc.float() / v_scale).to(torch.float8_e4m3fn)
        ref_k, ref_v = kc.double() * k_scale, vc.double() * v_scale
        kw = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        ref_k, ref_v = kc, vc
    expected = reference(query, ref_k, ref_v, bt, seq_lens, qsl, scale=scale, window=window, softcap=softcap)
    dev = [t.cuda() for t in (query, kc, vc, bt, seq_lens, qsl)]
    out = torch.full(query.shape, NAN, dtype=dtype, device="cuda")
    if unsplit:  # one CTA walks each row's whole key range (no key splits)
        plan = ops.plan_attention(qsl.numpy(), seq_lens.numpy(), query.shape[1], num_kv_heads, torch.device("cuda"),
                                  head_dim, dtype)
        plan.num_splits = plan.decode_splits = 1
        kw["plan"] = plan
    if graph_plan_len:  # decode rows under the plan a CUDA graph holds: splits for the longest possible row
        assert all(q == 1 for q, _ in rows)
        plan = ops.plan_decode(len(rows), num_kv_heads, torch.device("cuda"), graph_plan_len)
        kw["plan"] = plan
    if mixed_graph:  # (tokens, tile splits): a whole mixed graph's padded plan; the last row is its padding row
        tokens, tile_splits = mixed_graph
        assert rows[-1] == (1, 1)
        padded = ops.planning.PaddedPlan(tokens, 64, 8, query.shape[1], num_kv_heads, head_dim, dtype,
                                         torch.device("cuda"), 4096, tile_splits=tile_splits)
        assert padded.fill(qsl[:-1].numpy(), seq_lens[:-1].numpy(), pad_row=len(rows) - 1)
        padded.upload()
        kw["plan"] = padded.plan
    for _ in range(repeat):  # the split counters must be back at zero for the next launch
        out.fill_(NAN)
        ops.paged_attention(*dev, scale=scale, sliding_window=window, softcap=softcap, out=out, **kw)
    torch.cuda.synchronize()
    out = out.cpu()
    n = int(qsl[-1])
    assert torch.isnan(out[n:]).all(), "padding tokens after query_start_loc[-1] were written"
    assert not torch.isnan(out[:n]).any(), "a row was left unwritten or read a NaN slot"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out[:n].double(), expected[:n], atol=atol, rtol=rtol)
    return out[:n]


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 6, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_attention_grid(dtype, head_dim, group, block_size):
    run_cuda(mixed_rows(block_size), block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_attention_other_head_dims(head_dim):
    run_cuda(mixed_rows(16), block_size=16, head_dim=head_dim, group=2, dtype=torch.bfloat16)
    run_cuda(mixed_rows(16), block_size=16, head_dim=head_dim, group=12, dtype=torch.float16,
             fp8_scales=(0.5, 1.5))


@pytest.mark.parametrize("window,softcap", [(13, 0.0), (0, 2.0), (40, 3.5)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_attention_window_softcap(dtype, window, softcap):
    run_cuda(mixed_rows(16), block_size=16, head_dim=128, group=4, dtype=dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("rows", [[(1, 3000), (1, 700)], [(1, 5000)], [(1, 1), (1, 2049)], [(3, 4000)]])
@pytest.mark.parametrize("group", [1, 4])
def test_attention_splits_keys_of_few_long_rows(rows, group):
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    device = torch.device("cuda")
    plan = ops.plan_attention(qsl, [s for _, s in rows], 2 * group, 2, device)
    assert plan.num_splits > 1 and plan.num_decode == 0
    for dtype in (torch.float32, torch.bfloat16):
        plan = ops.plan_attention(qsl, [s for _, s in rows], 2 * group, 2, device, 128, dtype)
        if rows[0][0] == 1:  # decode rows: the decode kernel, keys split too
            assert plan.num_decode == len(rows) and plan.decode_splits > 1
        run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=dtype)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rows_of_a_few_queries_take_the_decode_kernel(dtype, group):
    # Speculative-decoding shapes: rows whose query tokens x group fit 16 vectors go to
    # the decode kernel (key splits, causal masks between their own queries), the rest
    # to prefill tiles.
    rows = [(2, 100), (4, 3000), (16, 40), (5, 700), (3, 6000), (1, 20)]
    qsl = np.cumsum([0] + [q for q, _ in rows])
    plan = ops.plan_attention(qsl, [n for _, n in rows], 2 * group, 2, torch.device("cuda"), 128, dtype)
    assert plan.num_decode == sum(q * group <= 16 for q, _ in rows)
    if group <= 4:  # (4, 3000) and (3, 6000) are decode rows: their keys split
        assert plan.decode_splits > 1
    for fp8 in (None, (0.5, 2.0)):
        run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=dtype, fp8_scales=fp8)
    run_cuda(rows, block_size=16, head_dim=64, group=group, dtype=dtype, window=50, softcap=3.0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_decode_rows_shorter_than_the_graph_plan(monkeypatch, dtype, window, fp8):
    # A graph's plan splits keys for its longest possible row (here up to 64 splits);
    # shorter rows run fewer splits (unsplit under 512 keys, else one per 64 keys at
    # most): lengths around those boundaries, split counts from 1 up, the planned
    # maximum.
    if fp8 and dtype == torch.float32:
        pytest.skip("no fp8 cache with float32 queries")
    scales = (0.5, 1.5) if fp8 else None
    lengths = [1, 17, 255, 256, 511, 512, 513, 767, 1024, 1500, 4097, 9000, 20000]
    for one_wave in ("0", "1"):  # (the plan for two CTAs an SM splits more: >= 8)
        monkeypatch.setenv("PAGEDCORE_DECODE_ONE_WAVE", one_wave)
        planned = ops.plan_decode(len(lengths), 2, torch.device("cuda"), 32768).decode_splits
        assert planned >= (8 if one_wave == "0" else 4)
        run_cuda([(1, n) for n in lengths], block_size=16, head_dim=128, group=4, dtype=dtype, window=window,
                 graph_plan_len=32768, repeat=3, fp8_scales=scales)
    monkeypatch.delenv("PAGEDCORE_DECODE_ONE_WAVE")
    assert ops.plan_decode(1, 2, torch.device("cuda"), 32768).decode_splits == 64
    for n in (300, 1500, 20000):  # one row alone: 64 splits planned, 1, 23 and 64 run
        run_cuda([(1, n)], block_size=16, head_dim=128, group=4, dtype=dtype, window=window,
                 graph_plan_len=32768, repeat=2, fp8_scales=scales)
    run_cuda([(1, n) for n in (5, 600, 2000)], block_size=32, head_dim=64, group=3, dtype=dtype, num_kv_heads=3,
             graph_plan_len=8192, repeat=2, fp8_scales=(1.0, 1.0) if fp8 else None)


@pytest.mark.parametrize("tile_splits", [1, 4])
@pytest.mark.parametrize("spare", ["0", "1"], ids=["padded_tiles", "spare_tiles"])
@pytest.mark.parametrize("kernel", ["auto", "mma", "wgmma", "wgmma-tma", "wgmma-tma-pairs"])
def test_mixed_graph_plans(monkeypatch, kernel, spare, tile_splits):
    # A whole mixed graph's plan (512 tokens): the step's decode rows and prefill
    # chunks, then its padding row (one query over one key). Its items past the
    # step's compute the padding row, or with PAGEDCORE_MIXED_TILE_SPARE=1 the tile
    # items are spare (-1): the prefill kernels' CTAs return at once, the persistent
    # wgmma walk passes them by. Every prefill kernel (the wgmma ones are mma.sync
    # off sm_90), bf16/fp16 and fp8 caches, float32, tiles split 4 ways (merged in
    # the kernels), 20 query heads a kv head (no decode kernel: every row in tiles,
    # the padding row in the first spare tile's place); twice (counters back at 0).
    monkeypatch.setenv("PAGEDCORE_PREFILL_KERNEL", kernel)
    monkeypatch.setenv("PAGEDCORE_MIXED_TILE_SPARE", spare)
    # (the persistent wgmma-tma walk from the plan's first item with spare tiles, from its last with padded ones)
    monkeypatch.setenv("PAGEDCORE_PREFILL_WALK", "start" if spare == "1" else "end")
    rows = [(1, 300)] * 5 + [(70, 170), (9, 409), (200, 1000), (1, 1)]
    for head_dim, group, kv_heads in ((128, 4, 2), (64, 3, 3)):
        for dtype in (torch.bfloat16, torch.float16):
            run_cuda(rows, block_size=16, head_dim=head_dim, group=group, num_kv_heads=kv_heads, dtype=dtype,
                     mixed_graph=(512, tile_splits), repeat=2)
        run_cuda(rows, block_size=16, head_dim=head_dim, group=group, num_kv_heads=kv_heads, dtype=torch.bfloat16,
                 mixed_graph=(512, tile_splits), repeat=2, fp8_scales=(0.5, 1.5))
    assert not _C.cuda_decode_supported(20, 64, 2)
    run_cuda(rows, block_size=16, head_dim=64, group=20, num_kv_heads=1, dtype=torch.bfloat16,
             mixed_graph=(512, tile_splits), repeat=2)
    if kernel == "auto":
        run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.float32, mixed_graph=(512, tile_splits),
                 repeat=2)


@pytest.mark.parametrize("env", [
    {"PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_DEEP_CTAS": "100000"},
    {"PAGEDCORE_FP8_FAST_CVT": "0"},
    {"PAGEDCORE_DECODE_EARLY_META": "0", "PAGEDCORE_FP8_WIDE_TILES": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_EARLY_META": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "100000"},
    {"PAGEDCORE_DECODE_EARLY_META": "2"},
    {"PAGEDCORE_DECODE_ONE_WAVE": "0"},
    {"PAGEDCORE_ATTN_PAD": "16"},
    {"PAGEDCORE_ATTN_PAD": "16", "PAGEDCORE_DECODE_DEEP_CTAS": "100000"},
    {"PAGEDCORE_DECODE_WIDE_D64": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_FP8_CVT_MIX": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_FP8_CVT_MIX": "2", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "100000"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "0", "PAGEDCORE_ATTN_PAD": "16"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "0", "PAGEDCORE_FP8_CVT_MIX": "2"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "0", "PAGEDCORE_FP8_CVT_MIX": "0"},
    {"PAGEDCORE_DECODE_KEYS_IN_M": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_TMA": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_TMA_L2": "256", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_TMA_SPREAD": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_TMA_SKEW": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_WGMMA": "1", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_MERGE": "0"},
    {"PAGEDCORE_DECODE_MERGE": "0", "PAGEDCORE_DECODE_DEEP_CTAS": "0"},
    {"PAGEDCORE_DECODE_CLUSTER": "4"},
    {"PAGEDCORE_DECODE_CLUSTER": "8", "PAGEDCORE_DECODE_CLUSTER_ASYNC": "1"},
], ids=["shallow", "deep", "fp8-cvt", "early-off-narrow-fp8", "early-meta-fp8-deep", "early-l2", "two-an-sm",
        "padded", "padded-deep", "narrow-d64", "fp8-int", "fp8-all-cvt-wide", "keys-in-m", "keys-in-m-deep",
        "keys-in-m-padded", "keys-in-m-fp8-all-cvt", "keys-in-m-fp8-int",
        "keys-in-m-off", "tma-off", "tma-l2-256", "tma-warp0-issue", "tma-tile-barrier", "fp8-wgmma",
        "two-pass-merge", "two-pass-merge-shallow", "cluster-4", "cluster-8-async"])
def test_decode_kernel_variants(monkeypatch, env):
    # The decode kernel's pipelines (three tiles in flight, or five for launches of few
    # CTAs), fp8 widenings (integer operations, or the cvt unit), the lengths and first
    # block ids read before the PDL wait (and the first tiles prefetched into L2 there),
    # 128-key fp8 tiles, each forced: the defaults pick per launch, so that each would
    # otherwise run only on some shapes. The defaults (early metadata over 16-bit caches,
    # 128-key fp8 tiles) run in "shallow"; "early-off-narrow-fp8": the paths they left
    # (metadata after the wait, 64-key fp8 tiles), "early-meta-fp8-deep": early metadata
    # over fp8 and in the deep pipeline; "two-an-sm": decode key splits planned for two
    # CTAs an SM throughout (the default plans one wave of one CTA an SM where that fills
    # the GPU, so the split launches of few rows are deep); "padded*": staged rows padded
    # by 16 bytes (the default swizzles them over 16-bit caches at head dim 128);
    # "narrow-d64": 64-key tiles, three stages, padded rows over 16-bit caches at head dim 64
    # (the default takes 128-key tiles, two stages, swizzled rows there); "fp8-int": fp8's K
    # widened by integer operations like V (the default widens K by the cvt unit in 128-key
    # tiles); "fp8-all-cvt-wide": both by the cvt unit in 128-key tiles; "keys-in-m*": keys
    # as the mma's rows, query vectors as its columns, wherever built (bf16 queries, or fp16
    # over fp8, at head dims 64 and 128; the rows of 16 vectors, group 8 x 2 queries, take its
    # second column tile; fp8 with either widening of V, or both by integer operations;
    # the default takes it for fp8 128-key tiles at head dim 128 only, "keys-in-m-off"
    # nowhere); "tma-off": fp8's keys-in-M tiles by cp.async (the default copies them by TMA
    # on Hopper: test_decode_tma_fp8; "tma-l2-256": their boxes' L2 promotion 256 bytes, not 128;
    # "tma-warp0-issue": their boxes issued by warp 0 alone, not by every warp, behind each
    # tile's barrier; "tma-tile-barrier": by every warp behind each tile's barrier, where the
    # default refills a stage once every warp arrived on its empty mbarrier);
    # "fp8-wgmma": fp8 decode at head dim 128 with bf16
    # queries on e4m3 wgmma (attention_decode_wgmma.cu; opt-in); "two-pass-merge*": a split
    # row's last CTA merging by count_and_merge (the default merges by count_and_merge_decode);
    # "cluster-*": rows under 512 keys shared by clusters of CTAs where the launch fits
    # (the trial PAGEDCORE_DECODE_CLUSTER; test_decode_cluster_rows forces it).
    # (The split rule PAGEDCORE_DECODE_BALANCE only changes a plan's split count:
    # test_mixed_graph_plan.py.)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    lengths = [1, 17, 255, 256, 513, 1500, 4097, 9000]
    for head_dim, scales in ((128, None), (128, (0.5, 1.5)), (64, None), (64, (1.0, 1.0)), (256, None)):
        run_cuda([(1, n) for n in lengths], block_size=16, head_dim=head_dim, group=4, dtype=torch.bfloat16,
                 graph_plan_len=16384, repeat=2, fp8_scales=scales)
        run_cuda([(1, 3000)], block_size=16, head_dim=head_dim, group=4, dtype=torch.float16, fp8_scales=scales)
    run_cuda(mixed_rows(16), block_size=16, head_dim=128, group=8, dtype=torch.bfloat16, window=40, softcap=3.5,
             fp8_scales=(0.25, 0.75))
    run_cuda(mixed_rows(16), block_size=16, head_dim=64, group=3, dtype=torch.bfloat16, window=40, softcap=3.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_after_the_cache_write_in_flight(dtype):
    # The model's order within a layer: the rotary kernel writes this step's key and
    # value into the cache, the decode attention reads them, both launched with PDL and
    # queued behind a busy GPU, eight steps in a row without a host wait. The decode
    # kernel reads the row's lengths and first block ids before its PDL wait (early
    # metadata), while the rotary may still run: this step's slot must be read after the
    # wait. Every slot a later step writes holds a key of 8.0 (a stale read dominates the
    # softmax) and a value of 1e4 until then. Rows whose new key lands in the first tiles
    # (deep pipeline: five stages of 64 keys, one CTA per row and kv head) and later ones.
    heads, kv_heads, hd, bs, steps = 32, 8, 128, 16, 8
    lengths = [1, 15, 63, 64, 200, 250, 700]
    g = torch.Generator().manual_seed(7)
    max_blocks = (max(lengths) + steps + bs - 1) // bs
    num_blocks = len(lengths) * max_blocks + 1
    tables = torch.randperm(num_blocks - 1, generator=g)[: len(lengths) * max_blocks].view(len(lengths), -1)
    tables = (tables + 1).to(torch.int32)
    kc = torch.full((num_blocks, bs, kv_heads, hd), 8.0, dtype=dtype)
    vc = torch.full((num_blocks, bs, kv_heads, hd), 1e4, dtype=dtype)
    for r, n in enumerate(lengths):  # the older keys
        for pos in range(n):
            b, o = tables[r, pos // bs], pos % bs
            kc[b, o] = torch.randn(kv_heads, hd, generator=g).to(dtype)
            vc[b, o] = torch.randn(kv_heads, hd, generator=g).to(dtype)
    kc, vc, tables = kc.to(DEV), vc.to(DEV), tables.to(DEV)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    table = ops.cos_sin_cache(inv_freq.float().to(DEV), 4096)
    rows = len(lengths)
    qs = [torch.randn(rows, heads, hd, generator=g).to(dtype).to(DEV) for _ in range(steps)]
    ks = [torch.randn(rows, kv_heads, hd, generator=g).to(dtype).to(DEV) for _ in range(steps)]
    vs = [torch.randn(rows, kv_heads, hd, generator=g).to(dtype).to(DEV) for _ in range(steps)]
    pos = [torch.tensor([n + s for n in lengths], dtype=torch.int64, device=DEV) for s in range(steps)]
    slots = [torch.tensor([int(tables[r, (n + s) // bs]) * bs + (n + s) % bs for r, n in enumerate(lengths)],
                          dtype=torch.int64, device=DEV) for s in range(steps)]
    seq_lens = [(p + 1).to(torch.int32) for p in pos]
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=DEV)
    outs = [torch.full((rows, heads, hd), NAN, dtype=dtype, device=DEV) for _ in range(steps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # (the launches below queue up behind it)
    for s in range(steps):
        ops.rotary_embedding(pos[s], qs[s], ks[s], table, value=vs[s], key_cache=kc, value_cache=vc,
                             slot_mapping=slots[s])
        ops.paged_attention(qs[s], kc, vc, tables, seq_lens[s], qsl, scale=hd**-0.5, out=outs[s])
    torch.cuda.synchronize()
    k_all, v_all = kc.double().cpu(), vc.double().cpu()
    for s in range(steps):
        q = qs[s].double().cpu()
        for r, n in enumerate(lengths):
            blocks = tables[r].cpu().long()
            keys = k_all[blocks].reshape(-1, kv_heads, hd)[: n + s + 1]
            vals = v_all[blocks].reshape(-1, kv_heads, hd)[: n + s + 1]
            kh = keys.repeat_interleave(heads // kv_heads, dim=1)
            vh = vals.repeat_interleave(heads // kv_heads, dim=1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[r], kh) * hd**-0.5, dim=-1)
            want = torch.einsum("hk,khd->hd", w, vh)
            got = outs[s][r].double().cpu()
            atol, rtol = TOLERANCE[dtype]
            assert torch.allclose(got, want, atol=atol, rtol=rtol), (
                f"step {s} row {r} (length {n + s + 1}): max error {(got - want).abs().max().item():.3g}")


@pytest.mark.parametrize("mode", ["barrier", "async"])
@pytest.mark.parametrize("cluster", [4, 8])
def test_decode_cluster_rows(monkeypatch, cluster, mode):
    # The trial PAGEDCORE_DECODE_CLUSTER (-C: an error, not another kernel, where it cannot
    # run): a decode row that one CTA would take alone (under 512 keys), or of at most C x
    # 128 keys (PAGEDCORE_DECODE_CLUSTER_KEYS's default), shared by a cluster of C CTAs,
    # each a C-th of its keys, merged through distributed shared memory (remote stores
    # behind the cluster barrier, or st.async completing on the owners' mbarriers);
    # longer rows of the same launch split as before. Rows of fewer keys than
    # C (CTAs without keys), around the tile and split edges, windows, soft caps, rows of a
    # few queries (8-16 vectors), head dims 64 and 128, bf16 and fp16, block sizes 16 and
    # 128, eager plans (no split planned) and the decode graphs' (8 planned; the launch
    # must fit one wave of one CTA an SM with its splits rounded up to whole clusters, and
    # its clusters must fit the GPU at once: so at head dim 64; at head dim 128 the graphs'
    # 128 CTAs make more clusters than fit the H200 at once, which -C refuses).
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", str(-cluster))
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER_ASYNC", "1" if mode == "async" else "0")
    # (every row the cluster's, however short; the default, 128, at the end)
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER_MIN_KEYS", "0")
    for n in (1, 3, 7, 64, 65, 255, 256, 511, 512, 513, 1024, 1025, 3000):
        run_cuda([(1, n)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, repeat=2)
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER_KEYS", "0")  # (rows that would run unsplit only)
    run_cuda([(1, n) for n in (100, 600)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, repeat=2)
    monkeypatch.delenv("PAGEDCORE_DECODE_CLUSTER_KEYS")
    lengths = [1, 5, 130, 256, 400, 511, 513, 1500]  # (8 rows x 2 kv heads: 8 splits planned)
    for block_size in (16, 128):
        for window in (0, 100):
            run_cuda([(1, n) for n in lengths], block_size=block_size, head_dim=64, group=4, dtype=torch.bfloat16,
                     window=window, graph_plan_len=8192, repeat=2)
    run_cuda([(1, n) for n in (1, 9, 100, 300, 511)], block_size=16, head_dim=64, group=3, dtype=torch.float16,
             num_kv_heads=3, softcap=3.0)
    # PAGEDCORE_DECODE_CLUSTER_MIN_KEYS (128 by default): rows under it run by their
    # cluster's first CTA alone, beside rows the cluster shares, eagerly and under a
    # graph's plan.
    monkeypatch.delenv("PAGEDCORE_DECODE_CLUSTER_MIN_KEYS")
    run_cuda([(1, n) for n in (1, 100, 127, 128, 400)], block_size=16, head_dim=128, group=4,
             dtype=torch.bfloat16, repeat=2)
    run_cuda([(1, n) for n in (5, 127, 128, 300, 1500)], block_size=16, head_dim=64, group=4, dtype=torch.bfloat16,
             graph_plan_len=8192, repeat=2)
    run_cuda([(2, 100), (4, 300), (3, 200), (1, 20)], block_size=16, head_dim=128, group=4, dtype=torch.float16)
    run_cuda([(2, 100), (2, 40)], block_size=16, head_dim=128, group=8, dtype=torch.bfloat16, window=50)


def test_decode_cluster_forced_is_an_error_beside_keys_in_m(monkeypatch):
    # PAGEDCORE_DECODE_CLUSTER=-C asks for the clusters or an error; the keys-in-M switch
    # takes a deep 16-bit launch to a kernel without clusters, so the two together fail.
    monkeypatch.setenv("PAGEDCORE_DECODE_KEYS_IN_M", "1")
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", "-4")
    with pytest.raises(RuntimeError, match="paged_attention: CUDA error"):
        run_cuda([(1, 300)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16)
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", "4")  # (C: the keys-in-M kernel instead)
    run_cuda([(1, 300)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16)


def test_decode_cluster_by_default(monkeypatch):
    # PAGEDCORE_DECODE_CLUSTER unset: the plan asks for clusters of 4 (st.async pushes)
    # where its longest decode row has 128 keys or more, and the launch takes them where
    # they fit (batch 1 eagerly; SmolLM2's 3 kv heads under a decode graph's plan), else
    # the plain kernel (8 kv heads under a graph's plan: 128 CTAs).
    monkeypatch.delenv("PAGEDCORE_DECODE_CLUSTER", raising=False)
    monkeypatch.delenv("PAGEDCORE_DECODE_CLUSTER_ASYNC", raising=False)
    for n in (100, 128, 300, 511, 600, 2000):
        run_cuda([(1, n)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, repeat=2)
    run_cuda([(1, 300), (1, 129)], block_size=16, head_dim=128, group=4, dtype=torch.float16, num_kv_heads=8,
             repeat=2)
    run_cuda([(1, n) for n in (5, 130, 400)], block_size=16, head_dim=64, group=3, dtype=torch.bfloat16,
             num_kv_heads=3, graph_plan_len=8192, repeat=2)
    run_cuda([(1, 20), (1, 160)], block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, num_kv_heads=8,
             graph_plan_len=8192, repeat=2)


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "mma-warp0-issue", "mma-tile-barrier", "mma-lean-off",
                                    "mma-128-key-tiles"])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_decode_tma_fp8(monkeypatch, block_size, kernel):
    # fp8 decode at head dim 128 with its K/V tiles brought by bulk tensor copies, one
    # per cache block, on e4m3 wgmma (PAGEDCORE_DECODE_WGMMA=2) or widened in the mma.sync
    # kernel (PAGEDCORE_DECODE_TMA=2; each =2: an error, not another kernel, if it cannot
    # run): a CTA's keys then start at a block boundary, so the rows' lengths, sliding
    # windows and key splits put range edges inside blocks and tiles; block size 8 rows
    # of 9000 keys cross a chunk of staged block ids (1024 blocks); rows of a few queries
    # and group 8 x 2 queries (the second column tile; wgmma: vectors 8-15). fp16 queries
    # only in the mma.sync kernel (wgmma serves bf16 queries: attention_decode_wgmma.cu), its
    # boxes issued by every warp, each stage refilled once every warp arrived on its empty
    # mbarrier (the default), by every warp behind each tile's barrier (PAGEDCORE_DECODE_TMA_SKEW=0),
    # or by warp 0 alone behind it (PAGEDCORE_DECODE_TMA_SPREAD=0); the default's tiles lean
    # (the narrow kernel where a plan allows it), "mma-lean-off" the kernel before them
    # (PAGEDCORE_DECODE_TMA_LEAN=0; test_decode_tma_lean_equals_the_kernel_before_it);
    # the default's narrow kernel in 64-key tiles at block sizes up to 64, "mma-128-key-tiles"
    # in 128-key tiles there too (PAGEDCORE_DECODE_TMA_KT64=0; the default's at block size 128).
    monkeypatch.setenv("PAGEDCORE_DECODE_TMA_KT64", "0" if kernel == "mma-128-key-tiles" else "1")
    if kernel == "wgmma":
        monkeypatch.setenv("PAGEDCORE_DECODE_WGMMA", "2")
    else:
        monkeypatch.setenv("PAGEDCORE_DECODE_WGMMA", "0")
        monkeypatch.setenv("PAGEDCORE_DECODE_TMA", "2")
        monkeypatch.setenv("PAGEDCORE_DECODE_TMA_SPREAD", "0" if kernel == "mma-warp0-issue" else "1")
        monkeypatch.setenv("PAGEDCORE_DECODE_TMA_SKEW", "0" if kernel == "mma-tile-barrier" else "1")
        monkeypatch.setenv("PAGEDCORE_DECODE_TMA_LEAN", "0" if kernel == "mma-lean-off" else "1")
    monkeypatch.setenv("PAGEDCORE_DECODE_DEEP_CTAS", "0")
    lengths = [1, 17, 255, 256, 513, 1500, 4097, 9000]
    for window in (0, 300):
        run_cuda([(1, n) for n in lengths], block_size=block_size, head_dim=128, group=4, dtype=torch.bfloat16,
                 window=window, graph_plan_len=16384, repeat=2, fp8_scales=(0.5, 1.5))
    run_cuda([(1, 3000), (1, 9000)], block_size=block_size, head_dim=128, group=4,
             dtype=torch.bfloat16 if kernel == "wgmma" else torch.float16,  # (wgmma: bf16 queries only)
             fp8_scales=(1.0, 1.0), unsplit=True)
    run_cuda(mixed_rows(block_size), block_size=block_size, head_dim=128, group=8, dtype=torch.bfloat16, window=40,
             softcap=3.5, fp8_scales=(0.25, 0.75))
    run_cuda([(2, 100), (4, 3000), (3, 6000), (1, 20)], block_size=block_size, head_dim=128, group=4,
             dtype=torch.bfloat16, fp8_scales=(0.5, 2.0))


@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_tma_lean_equals_the_kernel_before_it(monkeypatch, block_size):
    # The default's lean tiles (attention_mma.cu, LEAN) issue fewer instructions for the
    # same arithmetic as the kernel before them (PAGEDCORE_DECODE_TMA_LEAN=0): kLeanSoftmax,
    # K's high byte pairs widened without a shift, the mask only on tiles that are not
    # whole, the rows' maxima reduced across lanes only when one would rise; kLeanNarrow
    # with it, a kernel of one column tile and no softcap for launches whose plan has no
    # decode row of more than 8 vectors (decode_max_query_tokens x group) and no softcap,
    # else kLeanSoftmax alone. Their outputs are the old kernel's, bit for bit: whole
    # and partial tiles, windows, key splits, heads scaled up to 64x (sharp scores: rows'
    # maxima rise in later tiles, the rescale's path), rows of 2 queries x group 4 (8
    # vectors: narrow), and where narrow may not run (group 8 x 2 queries, the second
    # column tile; softcap; a graph's padded plan) the launch takes the wide one. Both in
    # 128-key tiles (PAGEDCORE_DECODE_TMA_KT64=0): the default's 64-key narrow tiles sum
    # the keys in another order (test_decode_tma_fp8 holds them to the reference).
    monkeypatch.setenv("PAGEDCORE_DECODE_TMA_KT64", "0")
    monkeypatch.setenv("PAGEDCORE_DECODE_WGMMA", "0")
    monkeypatch.setenv("PAGEDCORE_DECODE_TMA", "2")
    monkeypatch.setenv("PAGEDCORE_DECODE_DEEP_CTAS", "0")
    cases = [
        dict(rows=[(1, n) for n in (1, 17, 255, 256, 513, 1500, 4097, 9000)], group=4, dtype=torch.float16,
             window=0, softcap=0.0, fp8_scales=(0.5, 1.5), graph_plan_len=16384),
        dict(rows=[(1, n) for n in (300, 2000, 5000)], group=4, dtype=torch.bfloat16, window=300, softcap=0.0,
             fp8_scales=(1.0, 1.0)),
        dict(rows=[(1, n) for n in (700, 4097)], group=4, dtype=torch.float16, window=0, softcap=0.0,
             fp8_scales=(1.0, 1.0), head_scales=[1.0, 16.0, 64.0, 0.25, 4.0, 32.0, 1.0, 8.0]),
        dict(rows=mixed_rows(block_size), group=8, dtype=torch.bfloat16, window=40, softcap=3.5,
             fp8_scales=(0.25, 0.75)),
        dict(rows=[(1, 3000), (1, 9000)], group=4, dtype=torch.float16, window=0, softcap=0.0,
             fp8_scales=(1.0, 1.0), unsplit=True),
        dict(rows=[(2, 100), (1, 3000), (2, 5000)], group=4, dtype=torch.bfloat16, window=0, softcap=0.0,
             fp8_scales=(0.5, 2.0)),
        dict(rows=[(1, 300)] * 3 + [(70, 170), (1, 2048), (1, 1)], group=4, dtype=torch.bfloat16, window=0,
             softcap=0.0, fp8_scales=(0.5, 2.0), mixed_graph=(512, 1)),
    ]
    for seed, case in enumerate(cases):
        outs = []
        for lean in ("0", None):
            if lean is None:
                monkeypatch.delenv("PAGEDCORE_DECODE_TMA_LEAN", raising=False)
            else:
                monkeypatch.setenv("PAGEDCORE_DECODE_TMA_LEAN", lean)
            outs.append(run_cuda(block_size=block_size, head_dim=128, seed=seed, **case))
        assert torch.equal(outs[0], outs[1]), (seed, (outs[0].float() - outs[1].float()).abs().max())


@pytest.mark.parametrize("rows, group, softcap, lean, kt64, kernel, keys", [
    ([(1, 3000)] * 4, 4, 0.0, None, None, 3, 64), ([(1, 3000)] * 4, 4, 0.0, "0", None, 0, 128),
    ([(2, 3000), (1, 500)], 4, 0.0, None, None, 3, 64),  # (8 vectors: narrow)
    ([(1, 3000)] * 4, 8, 0.0, None, None, 3, 64),
    ([(3, 3000), (1, 500)], 4, 0.0, None, None, 2, 128),  # (12 vectors: wide)
    ([(2, 3000), (1, 500)], 8, 0.0, None, None, 2, 128),  # (16 vectors: wide)
    ([(2, 3000), (1, 500)], 8, 0.0, "0", None, 0, 128),
    ([(1, 3000)] * 4, 4, 3.5, None, None, 2, 128),  # (softcap: wide)
    # PAGEDCORE_DECODE_TMA_KT64=0: the narrow kernel in 128-key tiles, the others as before
    ([(1, 3000)] * 4, 4, 0.0, None, "0", 3, 128), ([(3, 3000), (1, 500)], 4, 0.0, None, "0", 2, 128),
    ([(1, 3000)] * 4, 4, 0.0, "0", "0", 0, 128),
])
def test_decode_tma_lean_picks_its_kernel(monkeypatch, rows, group, softcap, lean, kt64, kernel, keys):
    # Which kernel a launch takes (the LEAN template argument, last of mma_attention_kernel's,
    # and KT, its tile's keys, the seventh, read from the profiler's kernel names): by default
    # narrow and lean (3) only where the plan has no decode row of more than 8 vectors and
    # there is no softcap, in 64-key tiles at block sizes up to 64 (16 here), else lean and
    # wide (2) in 128-key tiles; PAGEDCORE_DECODE_TMA_LEAN=0, the kernel before them (0, 128
    # keys); PAGEDCORE_DECODE_TMA_KT64=0, the narrow kernel in 128-key tiles. (Not under
    # compute-sanitizer: the profiler's CUPTI takes no second subscriber.)
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("PAGEDCORE_DECODE_WGMMA", "0")
    monkeypatch.setenv("PAGEDCORE_DECODE_TMA", "2")
    monkeypatch.setenv("PAGEDCORE_DECODE_DEEP_CTAS", "0")
    for name, value in (("PAGEDCORE_DECODE_TMA_LEAN", lean), ("PAGEDCORE_DECODE_TMA_KT64", kt64)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=torch.bfloat16, softcap=softcap,
                 fp8_scales=(0.5, 2.0))
    launched = {e.name for e in prof.events() if "mma_attention_kernel<" in e.name}
    assert launched, sorted({e.name for e in prof.events()})
    args = [name.split("mma_attention_kernel<", 1)[1].split(">", 1)[0].split(",") for name in launched]
    leans = {int(re.search(r"(\d+)\s*$", a[-1]).group(1)) for a in args}
    assert leans == {kernel}, launched
    assert {int(re.search(r"\d+", a[6]).group(0)) for a in args} == {keys}, launched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("wgmma", ["0", "1"], ids=["widened", "wgmma"])
def test_decode_fp8_query_magnitudes(monkeypatch, dtype, wgmma):
    # fp8 decode at head dim 128 (widened to fp16 in the mma.sync kernel, or, with bf16
    # queries on Hopper, e4m3 wgmma, which takes each query vector at its own power-of-two
    # scale as two e4m3 terms, and P as two terms 2^6 larger; fp16 queries fall back to the
    # widened kernel) with the heads of one kv head 2^-12 .. 2^6 apart: tiny, ordinary, and
    # sharp scores that leave most keys' P far below the largest, against the float64
    # reference.
    monkeypatch.setenv("PAGEDCORE_DECODE_DEEP_CTAS", "0")
    monkeypatch.setenv("PAGEDCORE_DECODE_WGMMA", wgmma)
    lengths = [1, 17, 255, 256, 513, 1500, 4097]
    scales = [2.0**-12, 1.0, 8.0, 64.0, 0.01, 3.0, 0.5, 20.0]  # 2 kv heads x group 4
    run_cuda([(1, n) for n in lengths], block_size=16, head_dim=128, group=4, dtype=dtype, graph_plan_len=8192,
             fp8_scales=(0.5, 1.5), head_scales=scales)
    run_cuda([(1, 3000), (2, 700), (4, 900)], block_size=32, head_dim=128, group=4, dtype=dtype, fp8_scales=(1.0, 1.0),
             head_scales=scales)


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_fp8_cache(dtype, head_dim, group, block_size):
    # Against float64 attention over the dequantized cache: the kernel's own error only.
    run_cuda(mixed_rows(block_size), block_size=block_size, head_dim=head_dim, group=group, dtype=dtype,
             fp8_scales=(0.5, 2.0))


@pytest.mark.parametrize("rows", [[(1, 5000)], [(3, 4000), (1, 3000)]])
def test_attention_fp8_cache_splits_window_softcap(rows):
    run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, fp8_scales=(1.0, 1.0))
    run_cuda(mixed_rows(16), block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, window=40,
             softcap=3.5, fp8_scales=(0.25, 0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_rows_longer_than_one_staged_block_table(dtype):
    # Block size 8, no key splits: rows of 9000 keys (1125 blocks) go through more than
    # one chunk of staged block ids (1024 at a time), decode and prefill alike.
    run_cuda([(1, 9000), (40, 9000)], block_size=8, head_dim=128, group=4, dtype=dtype, unsplit=True)


def test_attention_large_prefill_and_many_decodes():
    rows = [(1, 100 + 37 * i) for i in range(100)] + [(600, 600), (300, 1000)]
    run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, num_kv_heads=4)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_reshape_and_cache(dtype, index_dtype):
    g = torch.Generator().manual_seed(3)
    kc = torch.full((6, 16, 2, 64), NAN, dtype=dtype)
    vc = kc.clone()
    qkv = torch.randn(19, 8 * 64, generator=g).to(dtype)  # fused: token stride 512
    k = qkv[:, 4 * 64:6 * 64].view(19, 2, 64)
    v = qkv[:, 6 * 64:].view(19, 2, 64)
    slots = torch.randperm(6 * 16, generator=g)[:19].to(index_dtype)
    slots[5] = -1  # padding
    kc_d, vc_d = kc.cuda(), vc.cuda()
    ops.reshape_and_cache(k.cuda(), v.cuda(), kc_d, vc_d, slots.cuda())
    expect_k, expect_v = kc.clone().view(-1, 2, 64), vc.clone().view(-1, 2, 64)
    keep = slots >= 0
    expect_k[slots[keep].long()] = k[keep]
    expect_v[slots[keep].long()] = v[keep]
    assert torch.equal(kc_d.cpu().view(-1, 2, 64).nan_to_num(7), expect_k.nan_to_num(7))
    assert torch.equal(vc_d.cpu().view(-1, 2, 64).nan_to_num(7), expect_v.nan_to_num(7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reshape_and_cache_fp8(dtype):
    g = torch.Generator().manual_seed(5)
    kc = torch.full((6, 16, 2, 64), float("nan"), dtype=torch.float32).to(torch.float8_e4m3fn)
    vc = kc.clone()
    k = (torch.randn(19, 2, 64, generator=g) * 3).to(dtype)
    v = (torch.randn(19, 2, 64, generator=g) * 3).to(dtype)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 447.0, 0.0], dtype=dtype)  # saturates at +-448 * scale
    slots = torch.randperm(6 * 16, generator=g)[:19]
    slots[5] = -1
    kc_d, vc_d = kc.cuda(), vc.cuda()
    ops.reshape_and_cache(k.cuda(), v.cuda(), kc_d, vc_d, slots.cuda(), k_scale=2.0, v_scale=0.5)
    keep = slots >= 0
    expect_k = kc.view(-1, 2, 64).float().clone()
    expect_v = vc.view(-1, 2, 64).float().clone()
    expect_k[slots[keep]] = (k[keep].float() / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    expect_v[slots[keep]] = (v[keep].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got_k = kc_d.cpu().view(-1, 2, 64).float()
    got_v = vc_d.cpu().view(-1, 2, 64).float()
    assert torch.equal(got_k.nan_to_num(7), expect_k.nan_to_num(7))
    assert torch.equal(got_v.nan_to_num(7), expect_v.nan_to_num(7))
    assert got_k[slots[0], 0, :4].tolist() == [448.0, -448.0, 224.0, 0.0]


def test_fp8_cache_bad_input():
    q = torch.randn(3, 4, 64, device="cuda")  # float32 queries cannot read an fp8 cache
    kc = torch.zeros(4, 16, 2, 64, device="cuda").to(torch.float8_e4m3fn)
    bt = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
    lens = torch.tensor([3], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="fp8.*bfloat16 or float16 query"):
        ops.paged_attention(q, kc, kc.clone(), bt, lens, qsl, scale=0.125)
    with pytest.raises(ValueError, match="k_scale must be a finite float > 0, got 0"):
        ops.paged_attention(q.bfloat16(), kc, kc.clone(), bt, lens, qsl, scale=0.125, k_scale=0)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v_scale must be a finite float > 0, got nan"):
        ops.reshape_and_cache(k, k, kc, kc.clone(), torch.arange(3, device="cuda"), v_scale=float("nan"))


def test_copy_blocks_every_layer_in_one_call():
    g = torch.Generator().manual_seed(4)
    ks = [torch.randn(10, 16, 2, 64, generator=g).cuda() for _ in range(3)]
    vs = [torch.randn(10, 16, 2, 64, generator=g).cuda() for _ in range(3)]
    before_k, before_v = [k.clone() for k in ks], [v.clone() for v in vs]
    pairs = torch.tensor([[1, 7], [2, 8], [1, 9]], dtype=torch.int32, device="cuda")
    ops.copy_blocks(ks, vs, pairs)
    for layer in range(3):
        ek, ev = before_k[layer].clone(), before_v[layer].clone()
        for s, d in pairs.tolist():
            ek[d], ev[d] = before_k[layer][s], before_v[layer][s]
        assert torch.equal(ks[layer], ek) and torch.equal(vs[layer], ev)


def test_swap_out_and_in_move_every_layer():
    g = torch.Generator().manual_seed(5)
    gpu = [torch.randn(12, 16, 2, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]
    cpu = [torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16).pin_memory() for _ in range(4)]
    out_pairs = torch.tensor([[3, 1], [7, 4], [11, 0]])
    ops.swap_out(gpu, cpu, out_pairs)
    torch.cuda.synchronize()  # the copies are queued on the stream
    for g_cache, c_cache in zip(gpu, cpu):
        for s, d in out_pairs.tolist():
            assert torch.equal(c_cache[d], g_cache[s].cpu())
    originals = [c.clone() for c in cpu]
    in_pairs = torch.tensor([[1, 9], [4, 2], [0, 5]])
    ops.swap_in(cpu, gpu, in_pairs)
    torch.cuda.synchronize()
    for g_cache, c_cache in zip(gpu, originals):
        for s, d in in_pairs.tolist():
            assert torch.equal(g_cache[d].cpu(), c_cache[s])


def test_swap_runs_and_gaps_touch_only_their_blocks():
    # Host blocks in runs with gaps: swap-out copies exact runs (the gaps hold other
    # sequences' blocks), swap-in joins runs up to 8 blocks apart and drops the gap rows.
    g = torch.Generator().manual_seed(6)
    gpu = [torch.randn(40, 16, 2, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]
    cpu = [torch.randn(40, 16, 2, 64, generator=g).to(torch.bfloat16).pin_memory() for _ in range(3)]
    host_ids = [11, 0, 1, 2, 3, 10, 20, 35]  # unsorted on purpose
    src = torch.randperm(40, generator=g)[: len(host_ids)]
    before_gpu, before_cpu = [t.clone() for t in gpu], [t.clone() for t in cpu]
    ops.swap_out(gpu, cpu, torch.stack([src, torch.tensor(host_ids)], dim=1))
    torch.cuda.synchronize()
    for layer in range(3):
        expect = before_cpu[layer].clone()
        expect[host_ids] = before_gpu[layer][src].cpu()
        assert torch.equal(cpu[layer], expect)
    dst = torch.randperm(40, generator=g)[: len(host_ids)]
    ops.swap_in(cpu, gpu, torch.stack([torch.tensor(host_ids), dst], dim=1))
    torch.cuda.synchronize()
    for layer in range(3):
        expect = before_gpu[layer].clone()
        expect[dst.cuda()] = cpu[layer][host_ids].cuda()
        assert torch.equal(gpu[layer], expect)


def test_index_checks_name_the_field():
    kc = torch.zeros(2, 16, 2, 64, device="cuda")
    k = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="slot_mapping holds 40, outside"):
        ops.reshape_and_cache(k, k, kc, kc.clone(), torch.tensor([40], device="cuda"))
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ops.reshape_and_cache(k, k, kc, kc.clone(), torch.tensor([1]))
